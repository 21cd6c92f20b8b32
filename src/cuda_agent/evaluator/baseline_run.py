"""Baseline process: times the task's `Model` in eager mode and under `torch.compile`.

`python -m cuda_agent.evaluator.baseline_run SPEC.json` runs in the sandbox with no
candidate code in it, so nothing a candidate does can make the baselines slower. It
compiles first (seconds of CPU work, which may overlap the candidate's verification),
marks its output directory `compiled`, then waits for `go` in the gate directory before
it measures, so that its timing never shares the device with another measurement. Its
`BaselineReport` is what `baselines.store` caches (files: `protocol.BaselineLayout`).
A spare (see `child`) has imported torch.compile's machinery, compiled a trivial function
and started the profiler once before its task is known.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cuda_agent.evaluator import child, distributions, timing, vouch  # they bind their clocks first
from cuda_agent.evaluator import protocol as P


def copy_bandwidth_gbps(device: Any) -> float:
    """Achieved device-to-device copy traffic (read + write) in GB/s, for plausibility checks."""
    import torch

    n = 256 << 20
    a = torch.empty(n // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * n * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def main(spec_path: Path, spare_stages: dict[str, float]) -> int:
    spec = P.BaselineSpec.read(spec_path)
    if spec is None:
        return 1  # the parent wrote it: never happens, and the parent reports no report
    layout = P.BaselineLayout(Path(spec.base))
    result = P.BaselineReport()
    phase = "import torch"
    t0 = time.perf_counter()
    try:
        import torch

        from cuda_agent.evaluator.tensors import seed_all, to_device
        from cuda_agent.tasks import import_task_module, task_from_code

        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device("cuda" if spec.device == "cuda" else "cpu")
        phase = "import task"
        task = task_from_code(layout.task_code.read_text(), name=spec.task_name, source=str(layout.task_code))
        mod = import_task_module(task)
        phase = "Model(*get_init_inputs())"
        seed_all(spec.init_seed)
        init_inputs = mod.get_init_inputs()
        init_inputs = list(init_inputs) if isinstance(init_inputs, (list, tuple)) else [init_inputs]
        seed_all(spec.init_seed)
        eager = mod.Model(*init_inputs).eval().to(device)
        sets = []
        first: Any = None
        for seed, kind in zip(spec.seeds, spec.distributions or [distributions.TASK] * len(spec.seeds), strict=True):
            phase = "get_inputs" if kind == distributions.TASK else f"get_inputs ({kind})"
            inputs = to_device(distributions.make_inputs(mod.get_inputs, seed, kind), device)
            if kind != distributions.TASK:
                # timed on the same kinds of inputs as the candidate: those the task is defined on
                if first is None:
                    with torch.no_grad():
                        first = eager(*sets[0])
                if distributions.judged_output(eager, inputs, first)[1]:
                    continue
            sets.append(inputs)
        phase = "torch.compile"
        t_c = time.perf_counter()
        compiled: Any = None
        # One try per process: a failed torch.compile can leave torch's import state half
        # made (a module that raised part-way registers its cache artifacts again when it
        # is imported again), so the evaluator retries in a fresh process instead.
        try:
            compiled = torch.compile(eager, mode=None if spec.compile_mode == "default" else spec.compile_mode)
            with torch.no_grad():
                got = compiled(*sets[0])
                want = eager(*sets[0])
            if device.type == "cuda":
                torch.cuda.synchronize()
            result.compile_matches_eager = _close(got, want)
        except Exception as exc:  # inductor cannot compile this model: compare to eager instead
            compiled = None
            result.compile_error = f"{type(exc).__name__}: {exc}"[:1500]
            result.compile_traceback = traceback.format_exc(limit=12)[-3000:]
        result.compile_s = time.perf_counter() - t_c
        P.write_marker(layout.out / P.COMPILED)
        phase = "waiting for the device"
        if not child.wait_for([layout.gate / P.GO], time.monotonic() + spec.gate_timeout_s):
            raise TimeoutError("never given the device to measure on")
        phase = "timing"
        subjects: dict[str, Any] = {"eager": eager}
        if compiled is not None:
            subjects["compile"] = compiled
        proto = timing.Protocol(**spec.protocol)
        spent: dict[str, float] = {}
        result.measure_s = spent
        try:
            res = timing.measure(subjects, sets, device.type, proto, spent_s=spent, probe=True)
        except Exception as exc:
            if compiled is None:
                raise
            # The compiled module compiled and matched, then failed on a later call (a
            # recompilation for new buffers, say): time eager alone, and say why.
            result.compile_error = f"the compiled module failed while timed: {type(exc).__name__}: {exc}"[:1500]
            result.compile_traceback = traceback.format_exc(limit=12)[-3000:]
            compiled, subjects = None, {"eager": eager}
            phase = "timing eager"
            res = timing.measure(subjects, sets, device.type, proto, spent_s=spent, probe=True)
        summaries = {name: m.summary() for name, m in res.items()}
        phase = "vouched batches"
        # The candidate's vouched batches are timed by the parent; these, of the same
        # batch function, by this trusted process's clock (see `vouch`).
        with torch.no_grad():
            ready_made = eager(*sets[0])
        vouched = {"null": vouch.time_batches(vouch.null_subject(ready_made), sets, device)}
        for name, subject in subjects.items():
            vouched[name] = vouch.time_batches(subject, sets, device)
        vouched.setdefault("compile", vouched["eager"])
        result.vouched = vouched
        result.eager = summaries["eager"]
        result.compile = summaries.get("compile", summaries["eager"])
        result.probe = summaries.get(timing.PROBE)
        if device.type == "cuda":
            result.copy_gbps = copy_bandwidth_gbps(device)
            result.device_name = torch.cuda.get_device_name(device)
        result.threads = torch.get_num_threads()
        result.torch_version = torch.__version__
        result.ok = True
    except BaseException as exc:  # the task's own code failed: report it, whatever it was
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        result.phase = phase
        result.traceback = traceback.format_exc(limit=8)[-3000:]
        P.write_marker(layout.out / P.COMPILED)  # (measuring may start: there is nothing to measure)
    result.seconds = time.perf_counter() - t0
    result.write(layout.report)
    return 0 if result.ok else 1


def _close(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2, equal_nan=True))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return True


def _imports() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from cuda_agent.evaluator import tensors, vouch  # noqa: F401
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def _warm_compiler_and_profiler() -> None:
    """torch.compile's workers and caches up, the profiler started once (on CUDA: on the
    CPU a trivial compile is a C++ build, seconds of the cores others are timed on)."""
    import torch

    x = torch.ones(1024, device="cuda")

    def trivial(t: Any) -> Any:
        return t * 2.0 + 1.0

    torch.compile(trivial)(x)
    torch.cuda.synchronize()
    torch._dynamo.reset()  # nothing of it stays in the way of the task's compilation
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        x.fill_(1.0)
        torch.cuda.synchronize()
    timing.profiled_events(prof)


WARMUP = child.Warmup(imports=_imports, cuda=_warm_compiler_and_profiler)

if __name__ == "__main__":
    # A normal exit, unlike the candidate's: torch.compile's worker processes are shut
    # down by its exit handlers, and ones left behind would hold the output pipes open.
    child.run(sys.argv[1:], main, WARMUP, hard_exit=False)
