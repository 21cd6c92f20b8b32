"""Repeatability of the timing: one correct solution evaluated N times, each in separate
processes with the baselines measured anew (`--fresh-baselines`), and the spread of every
time and speedup across runs.

    python benchmarks/profile_repeatability.py [--runs 10] [--device cuda] [--task T] [--solution S]
        [--json-out F [--resume]]

Prints, for candidate, eager and torch.compile (device time on CUDA) and for both speedups:
mean, min, max and the coefficient of variation (sample standard deviation over mean)
across runs. With `--resume` the runs already in the `--json-out` file count towards
`--runs` (so the runs can be split over several sessions on the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--task", type=Path, default=REPO / "benchmarks" / "tasks" / "axpby_large.py")
    ap.add_argument("--solution", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None, help="also write every run's record here")
    ap.add_argument("--resume", action="store_true", help="count the runs already in --json-out")
    ap.add_argument("--cached", action="store_true",
                    help="measure the baselines once and let later runs use the cache (as the agent's "
                         "evaluations do); reports how many runs re-measured them")
    args = ap.parse_args()
    if args.resume and not args.json_out:
        ap.error("--resume needs --json-out")
    sol = args.solution or REPO / "examples" / "solutions" / f"axpby_{args.device}"
    env = dict(os.environ)
    env.setdefault("CUDA_AGENT_CACHE", tempfile.mkdtemp(prefix="repeat-bench-"))
    series: dict[str, list[float]] = {k: [] for k in ("candidate", "eager", "compile", "eager_beside_candidate",
                                                      "probe_beside_candidate", "probe_beside_baselines",
                                                      "speedup_vs_eager", "speedup_vs_compile")}
    records: list[dict] = []

    def add(rec: dict) -> None:
        for k in ("candidate", "eager", "compile", "eager_beside_candidate"):
            series[k].append(rec["times_us"][k]["median_us"])
        for side, stats in ((rec.get("details") or {}).get("probe_us") or {}).items():
            series[f"probe_{side}"].append(stats["median_us"])
        series["speedup_vs_eager"].append(rec["speedup_vs_eager"])
        series["speedup_vs_compile"].append(rec["speedup_vs_compile"])

    if args.resume and args.json_out.exists():
        records = json.loads(args.json_out.read_text())
        for rec in records:
            add(rec)
        print(f"{len(records)} runs from {args.json_out}")
    for i in range(len(records), args.runs):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "eval", str(args.task), str(sol), "--json",
                            "--device", args.device, *([] if args.cached else ["--fresh-baselines"])],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise SystemExit(f"run {i + 1} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        rec = json.loads(p.stdout)
        records.append(rec)
        if rec["status"] != "ok" or not rec.get("times_us"):
            raise SystemExit(f"run {i + 1}: {rec['status']}: {rec['message'][:500]}")
        add(rec)
        print(f"run {i + 1:2d}: candidate {series['candidate'][-1]:9.3f} us  eager {series['eager'][-1]:9.3f}  "
              f"compile {series['compile'][-1]:9.3f}  vs compile {series['speedup_vs_compile'][-1]:.4f}  "
              f"reward {rec['reward']}  flags {rec.get('flags')}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.json_out:  # after every run, so a run cut short keeps what it measured
            args.json_out.write_text(json.dumps(records, indent=1))
    unit = "device time" if args.device == "cuda" else "time"
    print(f"\n{len(records)} separate evaluations of {sol.name} on {args.task.stem}, {args.device} ({unit}, median per run)")
    print(f"{'series':24s} {'mean':>10s} {'min':>10s} {'max':>10s} {'CoV %':>7s}")
    for k, xs in series.items():
        if not xs:
            continue
        m = statistics.fmean(xs)
        cov = statistics.stdev(xs) / m * 100 if m and len(xs) > 1 else float("nan")
        print(f"{k:24s} {m:10.4f} {min(xs):10.4f} {max(xs):10.4f} {cov:7.3f}")
    remeasured = sum("baselines-remeasured" in (r.get("flags") or []) for r in records)
    print(f"runs that re-measured the baselines: {remeasured} of {len(records)}"
          + (" (each run measured them anew: --fresh-baselines)" if not args.cached else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
