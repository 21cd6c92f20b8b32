"""Suite metrics, overall and per level, as the paper and KernelBench report them.

For N tasks (a missing solution counts as a task that failed):

- pass rate: correct / N
- faster than eager / than torch.compile: share of the N tasks that are correct and more
  than `threshold` faster ((t0 - t) / t0 > threshold, i.e. speedup > 1 / (1 - threshold)),
  and the same with no threshold (speedup > 1)
- geometric-mean speedups over the correct solutions (the paper's figure), and over all N
  with every failure counted as 1.0 (the user falls back to PyTorch); arithmetic mean and
  median over the correct ones
- fast_p (KernelBench): share of the N tasks that are correct with speedup > p
- reward distribution, counts of each status and flag
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from cuda_agent.bench.records import BenchRecord

FAST_P = (0.0, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0)


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def metrics(records: Iterable[BenchRecord], threshold: float = 0.05) -> dict[str, Any]:
    recs = list(records)
    n = len(recs)
    bound = 1.0 / (1.0 - threshold)
    out: dict[str, Any] = {"tasks": n, "threshold": threshold}
    if n == 0:
        return out
    correct = [r for r in recs if r.correct]
    out["correct"] = len(correct)
    out["pass_rate"] = _r(len(correct) / n)
    for base in ("eager", "compile"):
        sp = [getattr(r, f"speedup_vs_{base}") for r in correct]
        timed = [s for s in sp if s is not None]
        out[f"faster_than_{base}"] = _r(sum(1 for s in timed if s > bound) / n)
        out[f"faster_than_{base}_no_threshold"] = _r(sum(1 for s in timed if s > 1.0) / n)
        out[f"geomean_vs_{base}"] = _r(_geomean(timed))
        all_tasks = [s if (r.correct and s is not None) else 1.0
                     for r, s in ((r, getattr(r, f"speedup_vs_{base}")) for r in recs)]
        out[f"geomean_vs_{base}_all"] = _r(_geomean(all_tasks))
        out[f"mean_vs_{base}"] = _r(statistics.fmean(timed)) if timed else None
        out[f"median_vs_{base}"] = _r(statistics.median(timed)) if timed else None
        out[f"fast_p_vs_{base}"] = {str(p): _r(sum(1 for s in timed if s > p) / n) for p in FAST_P}
        out[f"fast_p_vs_{base}"]["0.0"] = _r(len(correct) / n)  # fast_0 is the correctness rate
    out["rewards"] = {str(k): v for k, v in sorted(Counter(r.reward for r in recs).items())}
    out["statuses"] = dict(sorted(Counter(r.status for r in recs).items()))
    out["flags"] = dict(sorted(Counter(f for r in recs for f in r.flags).items()))
    return out


def by_level(records: Iterable[BenchRecord], threshold: float = 0.05) -> dict[str, dict[str, Any]]:
    recs = list(records)
    levels = sorted({r.level for r in recs}, key=lambda s: (len(s), s))
    out = {lvl: metrics([r for r in recs if r.level == lvl], threshold) for lvl in levels}
    out["overall"] = metrics(recs, threshold)
    return out
