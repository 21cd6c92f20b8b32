"""One timing protocol for the candidate and both baselines (work in progress: the
profiling issue wires it into the evaluator; the CUDA path still needs a GPU run).

`measure(subjects, input_sets, device)` times several callables on the same device in
the same process, interleaved in rounds (so clock drift hits all alike), each timed call
preceded, outside the measurement, by fresh input values copied into its input buffers
(rotating among several input sets) and, on CUDA, an L2 flush.

- CPU: a monotonic clock around the call.
- CUDA: *device time*, the summed durations of all kernels and memory operations on all
  streams that ran while the call was in flight (profiler/CUPTI), beside *wall time*
  (CUDA events around the call plus a device-wide synchronisation inside the region).

Iterations stop when the median's relative 95% confidence interval is under the target
for every subject, or the budget is spent. The clocks used here are bound at import, so
a candidate imported later cannot monkey-patch them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
_perf_ns = time.perf_counter_ns  # bound before any candidate code is imported


@dataclass
class Protocol:
    warmup: int = 5
    min_iters: int = 10
    max_iters: int = 500
    target_rel_ci: float = 0.01
    budget_s: float = 20.0
    flush_l2: bool = True


@dataclass
class Stats:
    median_us: float
    min_us: float
    max_us: float
    mean_us: float
    iterations: int
    rel_ci: float  # half-width of the median's 95% CI over the median
    spread: float  # median absolute deviation over the median

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def median_rel_ci(samples: Sequence[float]) -> float:
    """Distribution-free 95% CI of the median from order statistics, as a fraction."""
    n = len(samples)
    if n < 3:
        return math.inf
    xs = sorted(samples)
    med = statistics.median(xs)
    if med <= 0:
        return math.inf
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)))
    return (xs[hi] - xs[lo]) / (2 * med)


def stats_of(samples_us: Sequence[float]) -> Stats:
    xs = list(samples_us)
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return Stats(median_us=med, min_us=min(xs), max_us=max(xs), mean_us=statistics.fmean(xs),
                 iterations=len(xs), rel_ci=median_rel_ci(xs), spread=mad / med if med > 0 else math.inf)


@dataclass
class Measurement:
    device_us: list[float] = field(default_factory=list)  # CUDA: profiler device time; CPU: = wall
    wall_us: list[float] = field(default_factory=list)
    kernels: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"device": stats_of(self.device_us).to_dict(), "wall": stats_of(self.wall_us).to_dict(),
                "kernels": dict(sorted(self.kernels.items(), key=lambda kv: -kv[1])[:20])}


def _refill(buffers: list[Any], source: list[Any]) -> None:
    """Write new values into the subject's input buffers (same memory, new contents)."""
    import torch

    for dst, src in zip(buffers, source, strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)


class _CpuClock:
    def time_call(self, fn: Callable[[], Any]) -> tuple[float, float]:
        t0 = _perf_ns()
        fn()
        dt = (_perf_ns() - t0) / 1e3
        return dt, dt


class _CudaClock:
    """Wall time with events + device sync; device time filled in from the profiler later."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = getattr(props, "L2_cache_size", 64 << 20) or (64 << 20)
        self.flush_buf = torch.empty(int(2 * l2) // 4 + 1024, dtype=torch.float32, device="cuda")

    def flush(self) -> None:
        self.flush_buf.fill_(0.0)
        self.torch.cuda.synchronize()

    def time_call(self, fn: Callable[[], Any]) -> tuple[float, float]:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        torch.cuda.synchronize()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) * 1e3
        return wall, math.nan


def measure(
    subjects: dict[str, Callable[..., Any]],
    input_sets: Sequence[list[Any]],
    device: str,
    protocol: Protocol | None = None,
) -> dict[str, Measurement]:
    """Time each subject on rotating input sets; returns raw samples per subject.

    `input_sets` are lists of tensors already on `device`; each subject gets its own
    buffers, refilled before every timed call from the next set.
    """
    import torch

    p = protocol or Protocol()
    names = list(subjects)
    buffers = {n: [t.clone() if isinstance(t, torch.Tensor) else t for t in input_sets[0]] for n in names}
    results = {n: Measurement() for n in names}
    cuda = device == "cuda"
    clock: Any = _CudaClock() if cuda else _CpuClock()

    with torch.no_grad():
        for n in names:
            for w in range(p.warmup):
                _refill(buffers[n], input_sets[w % len(input_sets)])
                subjects[n](*buffers[n])
        if cuda:
            torch.cuda.synchronize()

    deadline = _perf_ns() + int(p.budget_s * 1e9)
    tags: list[tuple[str, str]] = []
    prof = None
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
        prof.__enter__()
    try:
        k = 0
        with torch.no_grad():
            while True:
                order = names[k % len(names):] + names[: k % len(names)]
                for j, n in enumerate(order):
                    # Subjects of one round get different input sets, so an output left in
                    # freed memory by the subject before is never the right answer.
                    _refill(buffers[n], input_sets[(k + j) % len(input_sets)])
                    if cuda:
                        if p.flush_l2:
                            clock.flush()
                        else:
                            torch.cuda.synchronize()
                        tag = f"cuda_agent_timed_{n}_{k}"
                        tags.append((n, tag))
                        with torch.profiler.record_function(tag):
                            wall, dev = clock.time_call(lambda n=n: subjects[n](*buffers[n]))
                    else:
                        wall, dev = clock.time_call(lambda n=n: subjects[n](*buffers[n]))
                    results[n].wall_us.append(wall)
                    results[n].device_us.append(dev)
                k += 1
                if k >= p.max_iters or _perf_ns() > deadline:
                    break
                if k >= p.min_iters and not cuda and all(
                    median_rel_ci(results[n].wall_us) < p.target_rel_ci for n in names
                ):
                    break
                if cuda and k >= p.min_iters and k % 10 == 0 and all(
                    median_rel_ci(results[n].wall_us) < p.target_rel_ci for n in names
                ):
                    break
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    if prof is not None:
        _attribute_device_time(prof, tags, results)
    return results


def _attribute_device_time(prof: Any, tags: list[tuple[str, str]], results: dict[str, Measurement]) -> None:
    """Sum the GPU activity that ran inside each tagged range (the range ends after a
    device-wide synchronisation, so work on every stream has finished inside it)."""
    events = prof.events()
    ranges = {e.name: (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("cuda_agent_timed_")}
    gpu = sorted(
        (e for e in events if getattr(e.device_type, "name", "") == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    per_subject_index: dict[str, int] = {}
    for name, tag in tags:
        i = per_subject_index.get(name, 0)
        per_subject_index[name] = i + 1
        if tag not in ranges:
            continue
        lo, hi = ranges[tag]
        total = 0.0
        for e in gpu:
            s, t = e.time_range.start, e.time_range.end
            if s >= lo and t <= hi:
                total += t - s
                key = e.name[:80]
                results[name].kernels[key] = results[name].kernels.get(key, 0) + 1
        if i < len(results[name].device_us):
            results[name].device_us[i] = total
