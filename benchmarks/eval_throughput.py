"""Evaluations per GPU-hour at RL scale: the evaluation service under a rollout-like load
beside the same load through today's bench path, in one run.

    python benchmarks/eval_throughput.py [--device cuda] [--tasks 20] [--per-task 10] [--clients 32]

The workload (`workload.py`): `--per-task` solutions of each of `--tasks` synthesized tasks
(elementwise operator chains from the datagen sample), each variant new content: correct
ones of three speeds, incorrect ones and compile errors, shuffled. The tasks' baselines
are measured first (what `cuda-agent serve --prefetch` does before training starts), so
both paths find them cached and the comparison is of the evaluations alone.

1. The service: `cuda-agent serve`'s engine behind its HTTP server on loopback, `--clients`
   client threads each sending one request after another (retrying on 429), as an RL
   trainer's episodes would. Prints evaluations per GPU-hour, each worker's busy fraction,
   client-side p50/p95 latency, and every verdict against the one the variant must get.
2. Repeatability under load (`--repeat N`): one correct solution measured N times on the
   idle service, then N times while the load runs; the medians of speedup_vs_compile.
3. Today's bench path: `run_bench` over a second copy of the workload (new content, so no
   build is shared with the first), `--bench-share` of it (default all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from workload import Variant, workload  # noqa: E402


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))] if s else float("nan")


def run_service(variants: list[Variant], args: argparse.Namespace, gpus: list[int],
                repeat: Variant | None) -> dict[str, Any]:
    from cuda_agent.serve.client import HTTPClient
    from cuda_agent.serve.engine import Engine, ServiceConfig
    from cuda_agent.serve.http import Server

    cfg = ServiceConfig(device=args.device, gpus=gpus, workers=args.workers, build_workers=args.build_workers,
                        max_queue=args.clients * 2, eval_options={"run_timeout_s": 120.0})
    engine = Engine(cfg)
    server = Server(engine).start()
    engine.start()
    assert server.url is not None
    client = HTTPClient(server.url)
    out: dict[str, Any] = {}

    detail: list[dict[str, Any]] = []

    def speedup(k: int) -> float | None:
        assert repeat is not None
        ans = client.evaluate(repeat.task_code, repeat.task_name, repeat.files, {"seed": 1000 + k},
                              client="repeat", retry_full_s=600)
        res = ans.get("result") or {}
        # beside it, what tells a slow candidate process (vs eager, timed in the same process)
        # from a baseline that moved (vs compile, cached) when the two disagree
        detail.append({"speedup_vs_compile": res.get("speedup_vs_compile"),
                       "speedup_vs_eager": res.get("speedup_vs_eager"), "flags": res.get("flags"),
                       "warm_start": (res.get("details") or {}).get("warm_start"),
                       "baseline": (res.get("details") or {}).get("baseline")})
        return res.get("speedup_vs_compile")

    try:
        if repeat is not None and args.repeat:
            out["alone"] = [speedup(k) for k in range(args.repeat)]
            print(f"  repeat, service idle: speedup_vs_compile {out['alone']} ({detail})", flush=True)
        work = list(variants)
        lock = threading.Lock()
        results: list[tuple[Variant, dict[str, Any], float]] = []

        def client_loop(c: int) -> None:
            me = HTTPClient(server.url or "", name=f"client{c}")
            while True:
                with lock:
                    if not work:
                        return
                    v = work.pop()
                t0 = time.perf_counter()
                try:
                    ans = me.evaluate(v.task_code, v.task_name, v.files, client=f"client{c}", retry_full_s=3600)
                except Exception as exc:  # counted as a mismatch below
                    ans = {"status": "client-error", "error": str(exc)}
                with lock:
                    results.append((v, ans, time.perf_counter() - t0))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(args.clients)]
        for th in threads:
            th.start()
        loaded: list[float | None] = []
        if repeat is not None and args.repeat:
            # under load: its client's turn comes once in a round of the others' (fair queues),
            # so these run beside the load, not before it
            def measure_loaded() -> None:
                time.sleep(5.0)  # the queue fills first
                for k in range(args.repeat):
                    x = speedup(100 + k)
                    if any(th.is_alive() for th in threads):  # (one that ended after the load is not counted)
                        loaded.append(x)

            repeater = threading.Thread(target=measure_loaded, daemon=True)
            repeater.start()
        last = time.perf_counter()
        while any(th.is_alive() for th in threads):
            time.sleep(0.5)
            if time.perf_counter() - last > 15:
                print("  " + engine.progress_line(), flush=True)
                last = time.perf_counter()
        wall = time.perf_counter() - t0
        m = engine.metrics()
        if repeat is not None and args.repeat:
            repeater.join()
    finally:
        server.close(grace_s=0)
    got = [((ans.get("result") or {}).get("status") or ans.get("status")) for _, ans, _ in results]
    mismatches = [(v.task_name, v.kind, v.expect, g, (ans.get("result") or {}).get("message", "")[:200])
                  for (v, ans, _), g in zip(results, got, strict=True) if g != v.expect]
    lat = [s for _, _, s in results]
    # where an evaluation's time goes: the evaluator's own timings, median by expected verdict
    anatomy: dict[str, dict[str, float]] = {}
    for expect in sorted({v.expect for v, _, _ in results}):
        recs = [(ans.get("result") or {}) for v, ans, _ in results if v.expect == expect]
        keys = sorted({k for r in recs for k in (r.get("timings_s") or {})})
        anatomy[expect] = {k: round(statistics.median([r["timings_s"][k] for r in recs
                                                       if k in (r.get("timings_s") or {})]), 3) for k in keys}
    samples = {}  # one whole record of each kind: the processes' phases
    for v, ans, _ in results:
        samples.setdefault(v.kind, {"task": v.task_name, **(ans.get("result") or {})})
    out.update({
        "n": len(results), "wall_s": round(wall, 1),
        "evals_per_gpu_hour": round(3600 * len(results) / wall / len(gpus), 1),
        "busy_fraction": {w["name"]: w["busy_fraction"] for w in m["workers"]},
        "p50_s": round(pct(lat, 50), 2), "p95_s": round(pct(lat, 95), 2),
        "verdicts": {s: got.count(s) for s in sorted(set(map(str, got)))},
        "mismatches": mismatches[:20], "n_mismatches": len(mismatches),
        "worker_restarts": m["counts"]["worker_restarts"], "builds_failed_early": m["counts"]["builds_failed_early"],
        "loaded": loaded, "repeat_detail": detail, "anatomy_s": anatomy, "samples": samples,
    })
    return out


def run_bench_path(variants: list[Variant], args: argparse.Namespace, gpus: list[int], root: Path) -> dict[str, Any]:
    from cuda_agent.bench.jobs import BenchConfig
    from cuda_agent.bench.runner import run_bench
    from cuda_agent.bench.suite import load_suite

    tasks, sols = root / "suite" / "level1", root / "solutions"
    tasks.mkdir(parents=True)
    for i, v in enumerate(variants):
        name = f"{i + 1}_{v.task_name}_{v.kind}"
        (tasks / f"{name}.py").write_text(v.task_code)
        for rel, text in v.files.items():
            (sols / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (sols / name / rel).write_text(text)
    t0 = time.perf_counter()
    recs = run_bench(load_suite(tasks.parent), root / "bench-out", solutions=sols,
                     cfg=BenchConfig(device=args.device, gpus=gpus, workers=args.workers))
    wall = time.perf_counter() - t0
    return {"n": len(recs), "wall_s": round(wall, 1), "evals_per_gpu_hour": round(3600 * len(recs) / wall / len(gpus), 1),
            "verdicts": {s: sum(1 for r in recs if r.status == s) for s in sorted({r.status for r in recs})}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dataset", type=Path, help="default: the H200 sample on CUDA, ops50 on the CPU")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--per-task", type=int, default=10)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--workers", type=int, default=1, help="CPU backend: workers")
    ap.add_argument("--build-workers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="repeatability: measurements alone and under load")
    ap.add_argument("--bench-share", type=float, default=1.0, help="share of the workload run through the bench path")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eval-throughput-"))
    os.environ.setdefault("CUDA_AGENT_CACHE", str(root / "cache"))
    gpus = [int(g) for g in args.gpus.split(",")]
    dataset = args.dataset or REPO / "examples" / "datagen" / ("h200_205.jsonl" if args.device == "cuda" else "ops50.jsonl")

    from cuda_agent.evaluator.evaluate import EvalOptions, evaluate, prefetch_baselines
    from cuda_agent.evaluator.solution import solution_from_files
    from cuda_agent.tasks import task_from_code

    load = workload(dataset, args.device, tasks=args.tasks, per_task=args.per_task, seed=1)
    other = workload(dataset, args.device, tasks=args.tasks, per_task=args.per_task, seed=2)
    other = other[: max(1, round(len(other) * args.bench_share))]
    names = sorted({v.task_name for v in load})
    print(f"workload: {len(load)} solutions of {len(names)} tasks ({dataset.name}), {args.clients} clients, "
          f"{args.device} {gpus}", flush=True)

    # the machine's headers, and every task's baselines, before either path is timed
    t0 = time.perf_counter()
    first = next(v for v in load if v.expect == "ok")
    evaluate(task_from_code(first.task_code, name=first.task_name),
             solution_from_files(first.files), EvalOptions(device=args.device, profile=False))
    tasks = {v.task_name: v.task_code for v in load}
    pre = {n: prefetch_baselines(task_from_code(c, name=n), EvalOptions(device=args.device, gpu_index=gpus[0]))
           for n, c in tasks.items()}
    print(f"warm-up and baselines: {time.perf_counter() - t0:.1f} s ({pre})", flush=True)

    repeat = next((v for v in load if v.kind == "fused" and v.expect == "ok"), None)
    service = run_service(load, args, gpus, repeat)
    print(f"service: {json.dumps({k: v for k, v in service.items() if k != 'samples'})}", flush=True)
    bench = run_bench_path(other, args, gpus, root / "bench")
    print(f"bench path: {json.dumps(bench)}", flush=True)

    ratio = service["evals_per_gpu_hour"] / max(1e-9, bench["evals_per_gpu_hour"])
    print(f"\n{args.device}, GPUs {gpus}: {len(load)} rollout-like evaluations, {args.clients} clients")
    print(f"{'path':<12} {'n':>4} {'wall s':>8} {'evals/GPU-h':>12}")
    print(f"{'service':<12} {service['n']:>4} {service['wall_s']:>8} {service['evals_per_gpu_hour']:>12}")
    print(f"{'bench path':<12} {bench['n']:>4} {bench['wall_s']:>8} {bench['evals_per_gpu_hour']:>12}")
    print(f"service / bench path: {ratio:.2f}x; busy {service['busy_fraction']}; latency p50 {service['p50_s']} s, "
          f"p95 {service['p95_s']} s; verdicts {service['verdicts']}, {service['n_mismatches']} not as expected")
    alone = [x for x in service.get("alone", []) if x]
    loaded = [x for x in service.get("loaded", []) if x]
    if alone and loaded:
        a, b = statistics.median(alone), statistics.median(loaded)
        print(f"repeatability: speedup_vs_compile alone {a:.4f}, under load {b:.4f} ({100 * (b / a - 1):+.2f}%)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"service": service, "bench": bench, "ratio": ratio, "prefetch": pre},
                                            indent=1))
    return 0 if service["n_mismatches"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
