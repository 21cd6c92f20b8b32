"""One timing protocol for the candidate and both baselines.

`measure(subjects, input_sets, device)` times several callables on the same device in
the same process, interleaved in rounds (so clock drift hits all alike), each timed call
preceded, outside the measurement, by fresh input values copied into its input buffers
(rotating among several input sets; every third round into newly allocated buffers) and,
on CUDA, an L2 flush. The output of the last timed call on each input set is kept, so the
caller can check that timed calls computed the right answer (an output cache keyed by
pointer or shape fails that check).

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
    kernels: dict[str, int] = field(default_factory=dict)  # name -> launches seen
    kernel_us: dict[str, float] = field(default_factory=dict)  # name -> summed device time
    outputs: dict[int, Any] = field(default_factory=dict)  # input set -> last timed output

    def summary(self) -> dict[str, Any]:
        top = sorted(self.kernel_us.items(), key=lambda kv: -kv[1])[:20]
        return {"device": stats_of(self.device_us).to_dict(), "wall": stats_of(self.wall_us).to_dict(),
                "kernels": {k: {"calls": self.kernels.get(k, 0), "us": round(v, 3)} for k, v in top}}


def _refill(buffers: list[Any], source: list[Any]) -> None:
    """Write new values into the subject's input buffers (same memory, new contents)."""
    import torch

    for dst, src in zip(buffers, source, strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)


def _poison(obj: Any, spare: set[int]) -> None:
    """Overwrite output tensors, except those sharing memory with `spare` storages."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().data_ptr() in spare or obj.numel() == 0:
            return
        if obj.is_floating_point() or obj.is_complex():
            obj.detach().fill_(float("nan"))
        elif obj.dtype == torch.bool:
            obj.detach().fill_(False)
        else:
            obj.detach().fill_(-7)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _poison(x, spare)
    elif isinstance(obj, dict):
        for x in obj.values():
            _poison(x, spare)


def _fresh(source: list[Any]) -> list[Any]:
    import torch

    return [t.clone() if isinstance(t, torch.Tensor) else t for t in source]


class _CpuClock:
    def time_call(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        t0 = _perf_ns()
        out = fn()
        dt = (_perf_ns() - t0) / 1e3
        return dt, dt, out


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

    def time_call(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        torch.cuda.synchronize()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) * 1e3
        return wall, math.nan, out


def measure(
    subjects: dict[str, Callable[..., Any]],
    input_sets: Sequence[list[Any]],
    device: str,
    protocol: Protocol | None = None,
    keep_outputs: Sequence[str] = (),
) -> dict[str, Measurement]:
    """Time each subject on rotating input sets; returns raw samples per subject.

    `input_sets` are lists of tensors already on `device`; each subject gets its own
    buffers, refilled before every timed call from the next set. For the subjects named
    in `keep_outputs` the last timed output per input set is kept in `outputs`. Outputs
    must not alias inputs (the evaluator checks that before timing): they are poisoned
    when let go.
    """
    import torch

    p = protocol or Protocol()
    names = list(subjects)
    keep = set(keep_outputs)
    buffers = {n: _fresh(input_sets[0]) for n in names}
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
                    which = (k + j) % len(input_sets)
                    if k % 3 == 2:
                        buffers[n] = _fresh(input_sets[which])  # new memory, not only new values
                    else:
                        _refill(buffers[n], input_sets[which])
                    def call(n: str = n) -> Any:
                        return subjects[n](*buffers[n])

                    if cuda:
                        if p.flush_l2:
                            clock.flush()
                        else:
                            torch.cuda.synchronize()
                        tag = f"cuda_agent_timed_{n}_{k}"
                        tags.append((n, tag))
                        with torch.profiler.record_function(tag):
                            wall, dev, out = clock.time_call(call)
                    else:
                        wall, dev, out = clock.time_call(call)
                    results[n].wall_us.append(wall)
                    results[n].device_us.append(dev)
                    # Whatever output is let go is poisoned first, so no later call can find a
                    # right answer in freed memory (the uninitialised-output cheat).
                    if n in keep:
                        out, results[n].outputs[which] = results[n].outputs.get(which), out
                    _poison(out, {t.untyped_storage().data_ptr() for t in buffers[n]
                                  if isinstance(t, torch.Tensor)})
                    del out
                k += 1
                if k >= p.max_iters or _perf_ns() > deadline:
                    break
                if k >= p.min_iters and (not cuda or k % 10 == 0) and all(
                    median_rel_ci(results[n].wall_us) < p.target_rel_ci for n in names
                ):
                    break
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    if prof is not None:
        _attribute_device_time(prof, tags, results)
        # The stop rule above could only see wall time; on CUDA the device time is what counts.
    return results


def _attribute_device_time(prof: Any, tags: list[tuple[str, str]], results: dict[str, Measurement]) -> None:
    """Sum the GPU activity (kernels, memcpy, memset, on any stream) that started inside
    each tagged range. A range ends after a device-wide synchronisation, so all the work a
    call issued has finished inside it; between ranges lie the L2 flush and a sync, so a
    small offset between the CPU and GPU clocks cannot move work from one call to another."""
    import bisect

    events = prof.events()
    ranges = {e.name: (e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("cuda_agent_timed_")}
    gpu = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                  if getattr(e.device_type, "name", "") == "CUDA"), key=lambda x: x[0])
    starts = [g[0] for g in gpu]
    per_subject_index: dict[str, int] = {}
    for name, tag in tags:
        i = per_subject_index.get(name, 0)
        per_subject_index[name] = i + 1
        if tag not in ranges or i >= len(results[name].device_us):
            continue
        lo, hi = ranges[tag]
        total = 0.0
        m = results[name]
        for s, t, kname in gpu[bisect.bisect_left(starts, lo):bisect.bisect_right(starts, hi)]:
            total += t - s
            key = kname[:120]
            m.kernels[key] = m.kernels.get(key, 0) + 1
            m.kernel_us[key] = m.kernel_us.get(key, 0.0) + (t - s)
        m.device_us[i] = total
