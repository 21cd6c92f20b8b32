"""Where one evaluation's time goes: the evaluator's timings and each process's phases for
the workload's solutions of a few tasks (`workload.py`), smallest and largest inputs first.

    python benchmarks/eval_anatomy.py [--device cuda] [--tasks 2] [--kinds fused,wrong] [--warm]

Per evaluation: the verdict, `timings_s` (build, reference, candidate, profile, baseline,
total) and when each phase of the reference and candidate processes began. The baselines
are measured first and reported apart. With `--warm` every solution is evaluated twice in
one process, the second time with the first's spare processes ready (as the service's
workers run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from workload import input_bytes, workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dataset", type=Path)
    ap.add_argument("--tasks", type=int, default=2, help="the smallest and largest (then the next) tasks")
    ap.add_argument("--kinds", default="fused,wrong")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    dataset = args.dataset or REPO / "examples" / "datagen" / ("h200_205.jsonl" if args.device == "cuda" else "ops50.jsonl")

    from cuda_agent.evaluator.evaluate import EvalOptions, evaluate, prefetch_baselines
    from cuda_agent.evaluator.solution import solution_from_files
    from cuda_agent.tasks import task_from_code

    every = workload(dataset, args.device, tasks=10**6, per_task=len(args.kinds.split(",")) * 5, seed=1)
    by_size = sorted({v.task_name: v for v in every}.values(), key=lambda v: input_bytes(v.task_code))
    picked: list[str] = []
    while len(picked) < min(args.tasks, len(by_size)):
        v = by_size.pop(0 if len(picked) % 2 == 0 else -1)
        picked.append(v.task_name)
    out = []
    for name in picked:
        vs = [v for v in every if v.task_name == name]
        task = task_from_code(vs[0].task_code, name=name)
        t0 = time.perf_counter()
        pre = prefetch_baselines(task, EvalOptions(device=args.device))
        print(f"\n{name}: inputs {input_bytes(vs[0].task_code) / 2**20:.0f} MiB; baselines {pre} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        for kind in args.kinds.split(","):
            v = next(x for x in vs if x.kind == kind)
            for rep in range(2 if args.warm else 1):
                t0 = time.perf_counter()
                r = evaluate(task, solution_from_files(v.files), EvalOptions(device=args.device, warm=args.warm))
                wall = time.perf_counter() - t0
                d = r.details
                row = {"task": name, "kind": kind, "rep": rep, "status": r.status, "expect": v.expect,
                       "wall_s": round(wall, 2), "timings_s": r.timings_s,
                       "evaluator_phases_s": d.get("evaluator_phases_s"),
                       "reference_phases_s": d.get("reference_phases_s"),
                       "candidate_phases_s": d.get("candidate_phases_s"), "warm_start": d.get("warm_start")}
                out.append(row)
                print(json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
