"""Evaluations per hour per GPU: the benchmark pool (builds ahead on a CPU pool while the
GPU times the previous solution) beside the same solutions evaluated one after another.

    python benchmarks/bench_throughput.py [--copies 6] [--device cuda]

Makes COPIES variants of each example solution (a comment changes the content hash, so
every variant is a cold build with a warm header cache), evaluates them (with profiling;
baselines cached after the first) once sequentially and once through `run_bench`, and
prints wall time, evaluations per hour per GPU, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    os.environ.setdefault("CUDA_AGENT_CACHE", str(root / "cache"))

    from cuda_agent.bench.jobs import BenchConfig
    from cuda_agent.bench.runner import run_bench
    from cuda_agent.bench.suite import load_suite
    from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
    from cuda_agent.evaluator.solution import load_solution

    sol = REPO / "examples" / "solutions" / f"axpby_{args.device}"
    kernel = next(p.name for p in (sol / "kernels").iterdir() if "binding" not in p.name)

    def make(tag: str) -> tuple[Path, Path]:
        tasks, sols = root / tag / "suite" / "level1", root / tag / "solutions"
        tasks.mkdir(parents=True)
        for i in range(args.copies):
            name = f"{i + 1}_axpby_{tag}"
            shutil.copy(REPO / "examples" / "tasks" / "axpby.py", tasks / f"{name}.py")
            shutil.copytree(sol, sols / name)
            k = sols / name / "kernels" / kernel
            k.write_text(k.read_text() + f"\n// variant {tag} {i} {time.time_ns()}\n")
        return tasks.parent, sols

    # warm: header cache and baselines, so both runs pay the same per-solution costs
    w_tasks, w_sols = make("warm")
    entries = load_suite(w_tasks)
    t0 = time.perf_counter()
    evaluate(entries[0].task, load_solution(w_sols / entries[0].task.name), EvalOptions(device=args.device))
    print(f"  warm-up evaluation (header, baselines): {time.perf_counter() - t0:.1f} s", flush=True)

    s_tasks, s_sols = make("seq")
    t0 = time.perf_counter()
    for e in load_suite(s_tasks):
        t1 = time.perf_counter()
        r = evaluate(e.task, load_solution(s_sols / e.task.name), EvalOptions(device=args.device))
        assert r.correct, r.message
        print(f"  one after another: {e.task.name} {time.perf_counter() - t1:.1f} s", flush=True)
    seq = time.perf_counter() - t0
    print(f"one after another: {seq:.1f} s for {args.copies}", flush=True)

    p_tasks, p_sols = make("pool")
    gpus = [0]
    t0 = time.perf_counter()
    recs = run_bench(load_suite(p_tasks), root / "pool-out", solutions=p_sols,
                     cfg=BenchConfig(device=args.device, gpus=gpus))  # builds overlap on CUDA only
    pool = time.perf_counter() - t0
    assert all(r.correct for r in recs), [r.message for r in recs if not r.correct]
    n = args.copies
    print(f"{n} solutions, each a cold build (warm header cache) + verification + profiling, {args.device}")
    print(f"one after another: {seq:7.1f} s  {3600 * n / seq:7.1f} evaluations/hour/GPU")
    print(f"bench pool:        {pool:7.1f} s  {3600 * n / pool / len(gpus):7.1f} evaluations/hour/GPU")
    print(f"ratio: {seq / pool:.2f}x")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
