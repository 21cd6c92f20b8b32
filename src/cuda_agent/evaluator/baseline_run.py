"""Baseline process: times the task's `Model` in eager mode and under `torch.compile`.

`python -m cuda_agent.evaluator.baseline_run SPEC.json` runs in the sandbox with no
candidate code in it, so nothing a candidate does can make the baselines slower. It
compiles first (seconds of CPU work, which may overlap the candidate's verification),
writes `compiled` to its output directory, then waits for `go` in the gate directory
before it measures, so that its timing never shares the device with another
measurement. The result, `baseline.json`, is what `baselines.store` caches.

`... SPEC.json --wait DEVICE IDLE_S` starts ahead of its job (see `warm`): torch, the CUDA
context, torch.compile's machinery (a trivial function compiled) and the profiler first,
then up to IDLE_S seconds of waiting for SPEC.json.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cuda_agent.evaluator import timing  # binds its clocks first
from cuda_agent.evaluator.waiting import wait_as_spare, wait_for


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


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    gate = Path(spec["gate_dir"])
    result: dict[str, Any] = {"ok": False}
    phase = "import torch"
    t0 = time.perf_counter()
    try:
        import torch

        from cuda_agent.evaluator.tensors import seed_all, to_device
        from cuda_agent.tasks import import_task_module, task_from_code

        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
        phase = "import task"
        task = task_from_code(Path(spec["task_path"]).read_text(), name=spec.get("task_name", "task"),
                              source=spec["task_path"])
        mod = import_task_module(task)
        phase = "Model(*get_init_inputs())"
        seed_all(spec["init_seed"])
        init_inputs = mod.get_init_inputs()
        init_inputs = list(init_inputs) if isinstance(init_inputs, (list, tuple)) else [init_inputs]
        seed_all(spec["init_seed"])
        eager = mod.Model(*init_inputs).eval().to(device)
        sets = []
        for seed in spec["seeds"]:
            phase = "get_inputs"
            seed_all(seed)
            inputs = mod.get_inputs()
            inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
            sets.append(to_device(inputs, device))
        phase = "torch.compile"
        t_c = time.perf_counter()
        compiled: Any = None
        # One try per process: a failed torch.compile can leave torch's import state half
        # made (a module that raised part-way registers its cache artifacts again when it
        # is imported again), so the evaluator retries in a fresh process instead.
        try:
            compiled = torch.compile(eager, mode=None if spec["compile_mode"] == "default" else spec["compile_mode"])
            with torch.no_grad():
                got = compiled(*sets[0])
                want = eager(*sets[0])
            if device.type == "cuda":
                torch.cuda.synchronize()
            result["compile_matches_eager"] = _close(got, want)
        except Exception as exc:  # inductor cannot compile this model: compare to eager instead
            compiled = None
            result["compile_error"] = f"{type(exc).__name__}: {exc}"[:1500]
            result["compile_traceback"] = traceback.format_exc(limit=12)[-3000:]
        result["compile_s"] = time.perf_counter() - t_c
        (out / "compiled").write_text("compiled")
        phase = "waiting for the device"
        if not wait_for([gate / "go"], time.monotonic() + spec.get("gate_timeout_s", 600)):
            raise TimeoutError("never given the device to measure on")
        phase = "timing"
        subjects: dict[str, Any] = {"eager": eager}
        if compiled is not None:
            subjects["compile"] = compiled
        proto = timing.Protocol(**spec["protocol"])
        spent: dict[str, float] = {}
        result["measure_s"] = spent
        try:
            res = timing.measure(subjects, sets, device.type, proto, spent_s=spent, probe=True)
        except Exception as exc:
            if compiled is None:
                raise
            # The compiled module compiled and matched, then failed on a later call (a
            # recompilation for new buffers, say): time eager alone, and say why.
            result["compile_error"] = f"the compiled module failed while timed: {type(exc).__name__}: {exc}"[:1500]
            result["compile_traceback"] = traceback.format_exc(limit=12)[-3000:]
            compiled, subjects = None, {"eager": eager}
            phase = "timing eager"
            res = timing.measure(subjects, sets, device.type, proto, spent_s=spent, probe=True)
        result.update({name: m.summary() for name, m in res.items()})
        if compiled is None:
            result["compile"] = result["eager"]
        if device.type == "cuda":
            result["copy_gbps"] = copy_bandwidth_gbps(device)
            result["device_name"] = torch.cuda.get_device_name(device)
        result["threads"] = torch.get_num_threads()
        result["torch_version"] = torch.__version__
        result["ok"] = True
    except BaseException as exc:  # the task's own code failed: report it, whatever it was
        result.update(error=f"{type(exc).__name__}: {exc}"[:2000], phase=phase,
                      traceback=traceback.format_exc(limit=8)[-3000:])
        (out / "compiled").write_text("failed")
    result["seconds"] = time.perf_counter() - t0
    tmp = out / "baseline.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "baseline.json")
    return 0 if result["ok"] else 1


def _close(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2, equal_nan=True))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return True


def warm_host(device: str) -> None:
    """Before its task is known, what touches only the host (on CUDA; see `candidate.warm_host`)."""
    if device == "cuda":
        _imports()


def _imports() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from cuda_agent.evaluator import tensors  # noqa: F401
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def warm_device(device: str) -> None:
    """The rest of what every baseline process does before its task is known."""
    _imports()
    if device != "cuda":
        return  # (a trivial compile on the CPU is a C++ build: seconds of the cores tests share)
    import torch

    torch.cuda.init()
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


def _entry(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--wait":
        if wait_as_spare(argv, warm_host, warm_device) is None:  # (in its output directory, its cwd)
            return 0
    return main(argv[0])


if __name__ == "__main__":
    # (A normal exit, unlike the candidate's: torch.compile's worker processes are shut
    # down by its exit handlers, and ones left behind would hold the output pipes open.)
    sys.exit(_entry(sys.argv[1:]))
