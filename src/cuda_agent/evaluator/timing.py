"""One timing protocol for the candidate and both baselines.

`measure(subjects, input_sets, device)` times several callables on the same device in
the same process, interleaved in rounds (so clock drift hits all alike). Before each
timed call, outside the measurement, new input values are written from one of the input
sets (`_write_inputs`): each contiguous floating-point or complex tensor of more than one
element gets its set's values in a new order, a random permutation of its elements when
it has at most `_PERMUTE_MAX` of them and a cyclic shift by a random offset when larger;
every other tensor (integer, bool, a single element, not contiguous) is copied as it is.
So, where a task has floating-point inputs, an output memo keyed by pointer, shape or
content (almost) never hits. In two rounds of three the values go into the subject's
existing buffers (same memory, new values), in the third into newly allocated ones. With
`Protocol.shift_inputs` off the sets are copied as they are. On CUDA the L2 cache is
flushed before each timed call.

Untimed *check calls* on the exact input sets are interleaved at random; the last one on
each set is kept so the caller can compare it with the reference: a cache keyed by
pointer or shape returns the answer of an earlier call there and fails that check.

- CPU: a monotonic clock around the call. The evaluator's timed processes keep freed
  memory for the next call (see `processes.python_env`), so a call's new outputs cost what
  they cost on CUDA's caching allocator, not page faults that vary between processes.
- CUDA: *device time*, the summed durations of all kernels and memory operations on all
  streams that ran while the call was in flight (profiler/CUPTI), beside *wall time*
  (CUDA events around the call plus a device-wide synchronisation inside the region).

With `probe`, a fixed workload that stands for the device's speed (see `probe_workload`)
is timed in the same rounds: the evaluator compares its time in the candidate's process
with its time where the baselines were measured, to tell a changed device from a noisy
task (eager PyTorch on a small task varies by tens of percent between processes).

Iterations stop when the median's relative 95% confidence interval is under the target
for every subject, or the budget is spent: on the CPU the wall time's, checked every round;
on CUDA the device time's, read from the profile every `Protocol.chunk` rounds or
`chunk_s` seconds (the profiler is stopped, its events attributed, and started again if
more rounds are needed).
Device time varies far less than wall time within a process, so on a small task this stops
after one chunk where a wall-time rule ran to `max_iters`. The clock and the random source used here are
bound at import, so a candidate imported later cannot monkey-patch or seed them.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Part of the baseline cache key: raised whenever a change makes times measured before it
# incomparable, so cached baselines are measured again (what each version changed:
# docs/design-log.md).
PROTOCOL_VERSION = 7
_perf_ns = time.perf_counter_ns  # bound before any candidate code is imported
_rng = random.Random(os.urandom(16))  # private: not the global generators a candidate can seed
# The profiler ranges around timed calls carry a name a candidate cannot know in advance,
# so a range it opens itself cannot stand in for one of them.
_TAG = f"cuda_agent_timed_{os.urandom(4).hex()}_"
CHECK_PROBABILITY = 0.2  # share of rounds followed by an untimed check call
PROBE = "probe"  # the subject name of the device probe


@dataclass
class Protocol:
    warmup: int = 5
    min_iters: int = 10
    max_iters: int = 500
    target_rel_ci: float = 0.01
    # CUDA: rounds are profiled in chunks of this many rounds or this many seconds, whichever
    # ends first; after each, the device times read so far decide whether to stop (their
    # median's relative CI under target_device_rel_ci).
    chunk: int = 100
    chunk_s: float = 0.5
    target_device_rel_ci: float = 0.005
    # subjects passed as `loose` (eager beside the candidate: a drift check, not the reward's
    # number) need only this, on CUDA and on the CPU
    loose_rel_ci: float = 0.03
    # the device probe: it decides drift beyond 10% and scales beyond its own 5% spread
    # between processes (`speed.PROBE_BAND`), so 1% is plenty; a tighter target kept a small
    # task's timing going long after the candidate had settled
    probe_rel_ci: float = 0.01
    budget_s: float = 20.0
    flush_l2: bool = True
    shift_inputs: bool = True  # new values per timed call (see the module text)


PROTOCOL_ENV = "CUDA_AGENT_PROTOCOL"


def default_protocol() -> Protocol:
    """The protocol of an evaluation that names none: `Protocol()`, with the fields given
    in $CUDA_AGENT_PROTOCOL changed ("budget_s=2,target_rel_ci=0.02"): quicker, noisier
    profiling on a slow or shared machine (the CPU test suite sets it). Baselines measured
    under another protocol are cached apart (it is part of their key)."""
    spec = os.environ.get(PROTOCOL_ENV, "").strip()
    if not spec:
        return Protocol()
    fields = Protocol.__dataclass_fields__
    changes: dict[str, object] = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip():
            raise ValueError(f"${PROTOCOL_ENV}: {item!r} is not NAME=VALUE with NAME one of {', '.join(fields)}")
        kind = type(getattr(Protocol(), name))
        changes[name] = value.strip().lower() in ("1", "true", "yes") if kind is bool else kind(value.strip())
    return Protocol(**changes)  # type: ignore[arg-type]


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
    outputs: dict[int, Any] = field(default_factory=dict)  # input set -> last check-call output
    streams: set[int] = field(default_factory=set)  # CUDA: streams the timed calls' GPU work ran on

    def summary(self) -> dict[str, Any]:
        top = sorted(self.kernel_us.items(), key=lambda kv: -kv[1])[:20]
        return {"device": stats_of(self.device_us).to_dict(), "wall": stats_of(self.wall_us).to_dict(),
                "kernels": {k: {"calls": self.kernels.get(k, 0), "us": round(v, 3)} for k, v in top},
                "streams": sorted(self.streams)}


def _write_inputs(buffers: list[Any], source: list[Any], shift: bool) -> None:
    """Write new values into the subject's input buffers (same memory, new contents).

    With `shift`, each contiguous floating-point or complex tensor of more than one element
    gets its source's values in a new order: a random permutation of its flattened elements
    when it is small (up to 65,536), a cyclic shift by a random offset when it is larger
    (one copy, no index tensor; offsets repeat with probability calls/elements, so an
    exact-content memo hits well under 1% of calls). The multiset of values is the
    source's, so ranges and signs the task relies on hold. Every other tensor (integer and
    bool ones: indices, masks) is copied as it is; what is not a tensor is left alone.
    """
    import torch

    for dst, src in zip(buffers, source, strict=True):
        if not isinstance(dst, torch.Tensor):
            continue
        n = src.numel()
        if shift and n > 1 and (src.is_floating_point() or src.is_complex()) and dst.is_contiguous() \
                and src.is_contiguous():
            d, f = dst.view(-1), src.view(-1)
            if n <= _PERMUTE_MAX:
                perm = torch.randperm(n, generator=_torch_generator(src.device), device=src.device)
                torch.index_select(f, 0, perm, out=d)
            else:
                s = _rng.randrange(1, n)
                d[: n - s].copy_(f[s:])
                d[n - s:].copy_(f[:s])
        else:
            dst.copy_(src)


_PERMUTE_MAX = 1 << 16
_generators: dict[str, Any] = {}


def _torch_generator(device: Any) -> Any:
    """A private torch generator per device, seeded from the private random source."""
    import torch

    key = str(device)
    if key not in _generators:
        _generators[key] = torch.Generator(device=device).manual_seed(_rng.getrandbits(63))
    return _generators[key]


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


def probe_workload(device: str) -> Callable[..., None]:
    """A fixed workload whose time stands for the device's speed: a copy of a buffer larger
    than any L2 cache (memory bandwidth) and a float32 matrix product (SM clocks). Its time
    varies far less between processes than a small task's eager time does. The tensors are
    made here, in the trusted code, before any candidate call; a candidate that slows it
    down (work left running, say) makes its own evaluation re-measure the baselines, one
    that speeds it up (a global TF32 switch) only shrinks its own speedups."""
    import torch

    cuda = device == "cuda"
    n_copy, n_mm = ((32 << 20), 1024) if cuda else ((2 << 20), 192)
    g = _torch_generator(device)
    src = torch.rand(n_copy, device=device, generator=g)
    dst = torch.empty_like(src)
    a = torch.rand(n_mm, n_mm, device=device, generator=g)
    b = torch.rand(n_mm, n_mm, device=device, generator=g)
    c = torch.empty(n_mm, n_mm, device=device)

    def run(*_ignored: Any) -> None:
        dst.copy_(src)
        torch.mm(a, b, out=c)

    return run


def warm_profiler(device: str) -> None:
    """Start and stop the profiler once on a trivial kernel: the first start in a process
    (CUPTI's) costs seconds, the later ones milliseconds. Called ahead of a measurement
    wherever those seconds should not fall inside it: a spare's warm-up, or datagen's check
    before it takes the device lock. Nothing on the CPU."""
    if device != "cuda":
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.empty(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        x.fill_(1.0)
        torch.cuda.synchronize()
    if not any(kind == "CUDA" for _, _, _, kind, _ in profiled_events(prof)):
        # a profiler whose activity kinds `DEVICE_WORK` does not name would time every call at 0
        raise RuntimeError("the profiler recorded no kernel for a fill; device time cannot be measured")


def measure(
    subjects: dict[str, Callable[..., Any]],
    input_sets: Sequence[list[Any]],
    device: str,
    protocol: Protocol | None = None,
    keep_outputs: Sequence[str] = (),
    spent_s: dict[str, Any] | None = None,
    probe: bool = False,
    loose: Sequence[str] = (),
) -> dict[str, Measurement]:
    """Time each subject on new input values per call; returns raw samples per subject.

    `input_sets` are lists of tensors already on `device`; each subject gets its own
    buffers. For the subjects named in `keep_outputs`, untimed check calls on the exact
    input sets are made at random between timed calls (and once more at the end for any
    set not yet checked); the last one per set is kept in `outputs`. Outputs must not
    alias inputs (the evaluator checks that before timing): they are poisoned when let go.
    `spent_s`, when given, is filled with where the time went: seconds of warm-up, timed
    rounds (and their parts: new inputs, flush, timed calls per subject, poisoning and check
    calls), final check calls and reading the profile, the number of rounds and, on CUDA,
    at each reading of the stop rule that did not stop, the subjects not yet within target. With
    `probe`, the device probe is one more subject, named `PROBE` (it takes no inputs).
    The stop rule asks the subjects in `loose` only for `Protocol.loose_rel_ci`, the probe
    for `Protocol.probe_rel_ci`; once within it (at a reading of the rule) they leave the
    rounds, while every other subject is timed in every round to the end.
    """
    import torch

    p = protocol or Protocol()
    if probe:
        subjects = {**subjects, PROBE: probe_workload(device)}
    names = list(subjects)
    keep = set(keep_outputs) - {PROBE}
    buffers = {n: _fresh(input_sets[0]) if n != PROBE else [] for n in names}
    last_set = {n: 0 for n in names}  # which input set the subject's buffers were last filled from
    results = {n: Measurement() for n in names}
    cuda = device == "cuda"
    clock: Any = _CudaClock() if cuda else _CpuClock()

    def spare(n: str) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in buffers[n] if isinstance(t, torch.Tensor)}

    def check_call(n: str, which: int | None = None) -> None:
        """Untimed call on an exact input set other than the one the buffers last held, so
        an answer cached from the call before (by pointer or shape) is the wrong answer."""
        if which is None:
            which = (last_set[n] + 1 + _rng.randrange(max(1, len(input_sets) - 1))) % len(input_sets) \
                if len(input_sets) > 1 else 0
        _write_inputs(buffers[n], input_sets[which], shift=False)
        last_set[n] = which
        out = subjects[n](*buffers[n])
        if cuda:
            torch.cuda.synchronize()
        out, results[n].outputs[which] = results[n].outputs.get(which), out
        _poison(out, spare(n))

    spent = spent_s if spent_s is not None else {}
    t_phase = _perf_ns()

    def lap(name: str) -> None:
        nonlocal t_phase
        now = _perf_ns()
        spent[name] = round((now - t_phase) / 1e9, 4)
        t_phase = now

    with torch.no_grad():
        for n in names:
            for w in range(p.warmup):
                if n != PROBE:
                    _write_inputs(buffers[n], input_sets[w % len(input_sets)], p.shift_inputs)
                subjects[n](*buffers[n])
        if cuda:
            torch.cuda.synchronize()

    lap("warm-up")
    deadline = _perf_ns() + int(p.budget_s * 1e9)
    tags: list[tuple[str, str, int]] = []  # (subject, range name, index of the call)
    prof = None
    events_s = 0.0

    def start_profile() -> None:
        nonlocal prof
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
        prof.__enter__()

    def end_profile() -> None:
        """Stop the profiler and fill in the device times of the calls it saw."""
        nonlocal prof, events_s
        if prof is None:
            return
        done, prof = prof, None
        done.__exit__(None, None, None)
        t = _perf_ns()
        _attribute_device_time(done, tags, results)
        tags.clear()
        events_s += (_perf_ns() - t) / 1e9

    def target(n: str, default: float) -> float:
        return p.probe_rel_ci if n == PROBE else p.loose_rel_ci if n in loose else default

    unsettled: list[str] = []  # per check of the rule: "round: subjects not yet within their target"
    # The probe and the loose subjects are checks (of the device, of drift), not the reward's
    # numbers: once within their target they are timed no longer, so the rounds a small
    # candidate still needs do not pay for a probe call each.
    aux = set(loose) | ({PROBE} if probe else set())
    active = list(names)

    def settled(samples: Callable[[str], list[float]], default: float, record: bool = False) -> bool:
        """Whether every subject still timed is within its target; checks within theirs leave."""
        late = [n for n in active if median_rel_ci(samples(n)) >= target(n, default)]
        if late and record:
            unsettled.append(f"{k}: {', '.join(late)}")
        active[:] = [n for n in active if n in late or n not in aux]
        return not late

    def device_us(n: str) -> list[float]:
        return [x for x in results[n].device_us if not math.isnan(x)]

    # where a round's host time goes (seconds): new inputs, the L2 flush (and its sync), the
    # timed calls per subject (their syncs included), and after them (poisoning, check calls)
    parts = {"inputs": 0, "flush": 0, "after": 0}
    call_ns = {n: 0 for n in names}
    if cuda:
        start_profile()
    try:
        k = 0
        last_check, last_check_ns = 0, _perf_ns()
        with torch.no_grad():
            while True:
                order = active[k % len(active):] + active[: k % len(active)]
                for j, n in enumerate(order):
                    # Subjects of one round start from different input sets, so an output left
                    # in freed memory by the subject before is never the right answer.
                    which = (k + j) % len(input_sets)
                    t0 = _perf_ns()
                    if n != PROBE:
                        if k % 3 == 2:
                            buffers[n] = _fresh(input_sets[which])  # new memory, not only new values
                        _write_inputs(buffers[n], input_sets[which], p.shift_inputs)
                        last_set[n] = which

                    def call(n: str = n) -> Any:
                        return subjects[n](*buffers[n])

                    t1 = _perf_ns()
                    if cuda:
                        if p.flush_l2:
                            clock.flush()
                        else:
                            torch.cuda.synchronize()
                    t2 = _perf_ns()
                    if cuda:
                        tag = f"{_TAG}{n}_{k}"
                        tags.append((n, tag, len(results[n].wall_us)))
                        with torch.profiler.record_function(tag):
                            wall, dev, out = clock.time_call(call)
                    else:
                        wall, dev, out = clock.time_call(call)
                    t3 = _perf_ns()
                    results[n].wall_us.append(wall)
                    results[n].device_us.append(dev)
                    # Whatever output is let go is poisoned first, so no later call can find a
                    # right answer in freed memory (the uninitialised-output cheat).
                    _poison(out, spare(n))
                    del out
                    if n in keep and _rng.random() < CHECK_PROBABILITY:
                        check_call(n)
                    parts["inputs"] += t1 - t0
                    parts["flush"] += t2 - t1
                    call_ns[n] += t3 - t2
                    parts["after"] += _perf_ns() - t3
                k += 1
                if k >= p.max_iters or _perf_ns() > deadline:
                    break
                if cuda:
                    # The stop rule looks at device time, what the reward counts; reading it
                    # needs the profile, so it is read every `chunk` rounds.
                    if k >= p.min_iters and (k - last_check >= p.chunk
                                             or _perf_ns() - last_check_ns >= p.chunk_s * 1e9):
                        end_profile()
                        if settled(device_us, p.target_device_rel_ci, record=True):
                            break
                        start_profile()
                        last_check, last_check_ns = k, _perf_ns()
                elif k >= p.min_iters and settled(lambda n: results[n].wall_us, p.target_rel_ci):
                    break
    finally:
        end_profile()
    lap("rounds")
    spent["rounds_n"] = k
    spent["round_parts"] = {name: round(v / 1e9, 4) for name, v in {**parts, "calls": sum(call_ns.values())}.items()}
    spent["calls_s"] = {n: round(v / 1e9, 4) for n, v in call_ns.items()}
    if unsettled:
        spent["unsettled"] = unsettled  # (what kept the rounds going: where the time went)
    with torch.no_grad():
        for n in names:
            if n in keep:
                for which in range(len(input_sets)):
                    if which in results[n].outputs:
                        continue
                    if which == last_set[n] and len(input_sets) > 1:
                        check_call(n)  # first move the buffers to another set's values
                    check_call(n, which)
    lap("checks")
    if cuda:
        spent["profile events"] = round(events_s, 4)  # (counted within the rounds too)
    return results


def _attribute_device_time(prof: Any, tags: list[tuple[str, str, int]], results: dict[str, Measurement]) -> None:
    """Sum the GPU activity (kernels, memcpy, memset, on any stream) that started inside
    each tagged range. A range ends after a device-wide synchronisation, so all the work a
    call issued has finished inside it; between ranges lie the L2 flush and a sync, so a
    small offset between the CPU and GPU clocks cannot move work from one call to another."""
    import bisect

    events = profiled_events(prof)
    ranges: dict[str, tuple[float, float]] = {}
    for name, start, end, kind, _ in events:  # the host's ranges, the first of each name
        if kind != "CUDA" and name.startswith(_TAG):
            ranges.setdefault(name, (start, end))
    gpu = sorted(((start, end, name, stream) for name, start, end, kind, stream in events if kind == "CUDA"),
                 key=lambda x: x[0])
    starts = [g[0] for g in gpu]
    for name, tag, i in tags:
        if tag not in ranges or i >= len(results[name].device_us):
            continue
        lo, hi = ranges[tag]
        total = 0.0
        m = results[name]
        for s, t, kname, stream in gpu[bisect.bisect_left(starts, lo):bisect.bisect_right(starts, hi)]:
            total += t - s
            m.streams.add(int(stream))
            key = kname[:120]
            m.kernels[key] = m.kernels.get(key, 0) + 1
            m.kernel_us[key] = m.kernel_us.get(key, 0.0) + (t - s)
        m.device_us[i] = total


# Device activity that is work. The profiler also puts on the device timeline a span per
# record_function range ("gpu_user_annotation": from the range's first activity to its
# last, host gaps included) and, where enabled, sync waits; summed with the kernels they
# double a one-kernel call's time and count the host's.
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

_FILTERED_NAMES = {"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
                   "profiler::_record_function_enter_new", "profiler::_record_function_exit",
                   "aten::is_leaf", "aten::output_nr", "aten::_version"}


def profiled_events(prof: Any) -> list[tuple[str, float, float, str, int]]:
    """(name, start us, end us, device type, stream) of each event of a finished profile.

    Read from the profiler's raw Kineto results, with the filters `prof.events()` applies
    (utility op names, hidden events). `prof.events()` builds a Python object with
    memory accounting per event, far slower than the raw list on the tens of thousands of
    events a timing run of a few hundred rounds holds. Times count from the trace start,
    for host ranges and device activity alike, as in `prof.events()`."""
    try:
        raw = prof.profiler.kineto_results
        t0 = raw.trace_start_ns()  # (microseconds since the epoch would lose a quarter of one to rounding)
        out = []
        for e in raw.events():
            name = e.name()
            if name in _FILTERED_NAMES or getattr(e, "is_hidden_event", lambda: False)():
                continue
            device = getattr(e.device_type(), "name", "")
            if device == "CUDA" and not _is_device_work(e):
                continue
            out.append((name, (e.start_ns() - t0) / 1e3, (e.end_ns() - t0) / 1e3, device,
                        int(e.device_resource_id())))
        return out
    except AttributeError:  # a torch without these raw results: its own (slower) list
        return [(e.name, e.time_range.start, e.time_range.end, getattr(e.device_type, "name", ""),
                 int(getattr(e, "device_resource_id", -1))) for e in prof.events()
                if not (getattr(e.device_type, "name", "") == "CUDA" and getattr(e, "is_user_annotation", False))]


def _is_device_work(e: Any) -> bool:
    """A kernel, copy or fill; not an annotation span or a sync wait (`DEVICE_WORK`)."""
    kind = getattr(e, "activity_type", None)
    if callable(kind):
        return kind() in DEVICE_WORK
    return not getattr(e, "is_user_annotation", lambda: False)()
