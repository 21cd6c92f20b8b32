"""The filter stages that run a candidate task, in a sandboxed process of their own.

`python -m cuda_agent.datagen.check SPEC.json` imports the task and writes `result.json`:
for each stage whether it passed and what was measured. The parent (`pipeline.py`) turns
that into a verdict; nothing here is trusted beyond the numbers it reports. With
`device_lock` in the spec, every timing holds that file's lock, so workers sharing a GPU
time one at a time (everything else runs side by side).

Stages, in order (the first failure ends the run):
- `runs`: `Model(*get_init_inputs())` and one eager forward work
- `calibrate` (when asked): the batch-size variable named by the parent is scaled until a
  quick eager timing lands inside the runtime range (the task's `get_inputs` reads the
  module global when called, so the later stages all run at the calibrated size)
- `deterministic`: the same seeds give exactly the same output
- `nontrivial`: the output is finite, not all zeros, has spread, and changes with the input
  beyond the evaluator's tolerance (`distributions.barely_varies`, the evaluator's flag)
- `compile`: `torch.compile` runs and matches eager (atol = rtol = 1e-2)
- `runtime`: eager (and compiled) time with the evaluator's timing protocol; before
  `compile`, a quick eager timing more than `EARLY_REJECT_FACTOR` outside the range ends it
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_device_lock: str | None = None  # from the spec: the lock file every timing holds
_device_wait_s = [0.0]


@contextmanager
def exclusive_device() -> Iterator[None]:
    if not _device_lock:
        yield
        return
    t0 = time.perf_counter()
    with open(_device_lock) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _device_wait_s[0] += time.perf_counter() - t0
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


CALIBRATION_ROUNDS = 4
# (1.3 was too little on a loaded 2-core CPU: a quick 0.39 ms measured 0.299 ms in full)
CALIBRATION_MARGIN = 1.5


def _input_bytes(xs: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(xs))


def calibrate(mod: Any, cal: dict[str, Any], build: Any, dev: Any, timing: Any) -> dict[str, Any]:
    """Scale `mod.<var>` (a batch size) until eager takes between min_ms and max_ms, aiming
    at twice min_ms (or less in a narrow range) and stopping only `CALIBRATION_MARGIN` inside
    the range, never past `max_input_bytes` of inputs;
    at most `CALIBRATION_ROUNDS` timings."""
    import torch

    var, lo, hi = cal["var"], float(cal["min_ms"]), float(cal["max_ms"])
    target = min(2 * lo, hi / 2 if hi > 2 * lo else hi)
    # A quick timing just inside the range can land just outside it when measured in full:
    # stop only with a margin to spare (where the range is wide enough for one).
    inner_lo, inner_hi = (lo * CALIBRATION_MARGIN, hi / CALIBRATION_MARGIN) if hi > lo * CALIBRATION_MARGIN ** 2 else (lo, hi)
    orig = getattr(mod, var, None)
    if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
        return {"ok": True, "skipped": f"no integer {var} to scale"}
    cur, ms, tried = orig, None, []
    for _ in range(CALIBRATION_ROUNDS):
        setattr(mod, var, cur)
        try:
            model, xs = build(0, 1)
            ms = quick_eager_ms(model, xs, dev, timing)
            nbytes = _input_bytes(xs)
        except torch.OutOfMemoryError:
            if not tried:
                raise
            cur, ms = tried[-1]  # the last size that fitted
            break
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        tried.append((cur, ms))
        if inner_lo <= ms <= inner_hi:
            break
        want = cur * target / max(ms, 1e-6)
        if ms < inner_lo:
            cap = int(cal.get("max_input_bytes", 2 << 30) * cur / max(nbytes, 1))
            new = min(int(want) + 1, cur * 64, cap)
            if new <= cur:
                break
        else:
            new = max(1, min(int(want), cur // 2))
            if new >= cur:
                break
        cur = new
    setattr(mod, var, cur)
    return {"ok": True, "var": var, "from": orig, "to": cur, "quick_eager_ms": round(ms or 0.0, 4),
            "rounds": len(tried), "final_size_timed": bool(tried) and tried[-1][0] == cur}


# A quick eager timing this far outside the runtime range rejects a task before
# torch.compile (seconds of CPU work per task); closer ones get the full measurement.
EARLY_REJECT_FACTOR = 2.0


def quick_eager_ms(model: Any, xs: list[Any], dev: Any, timing: Any) -> float:
    quick = timing.Protocol(warmup=2, min_iters=5, max_iters=30, target_rel_ci=0.05, budget_s=1.0)
    with exclusive_device():
        return timing.measure({"eager": model}, [xs], dev.type, quick)["eager"].summary()["device"]["median_us"] / 1e3


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    res: dict[str, Any] = {"stages": {}}
    stage = "runs"

    global _device_lock
    _device_lock = spec.get("device_lock")

    def done() -> int:
        if _device_lock:
            res["device_wait_s"] = round(_device_wait_s[0], 3)
        (out / "result.json").write_text(json.dumps(res))
        return 0

    try:
        import torch

        from cuda_agent.evaluator import distributions, timing
        from cuda_agent.evaluator.options import EvalOptions
        from cuda_agent.evaluator.tensors import seed_all, to_device
        from cuda_agent.tasks import import_task_module, task_from_code

        dev = torch.device(spec["device"])
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        task = task_from_code(Path(spec["task"]).read_text(), name="candidate", source=spec["task"])
        mod = import_task_module(task)

        def build(seed_init: int, seed_in: int) -> tuple[Any, list[Any]]:
            seed_all(seed_init)
            model = mod.Model(*mod.get_init_inputs()).eval().to(dev)
            return model, to_device(distributions.make_inputs(mod.get_inputs, seed_in, distributions.TASK), dev)

        with torch.no_grad():
            t0 = time.perf_counter()
            model, xs = build(0, 1)
            y1 = model(*xs)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res["stages"]["runs"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 3)}
            if spec.get("runtime", True):
                # CUPTI's first start (seconds) here, not inside the device lock, where
                # the workers sharing the GPU would wait for it one after another
                timing.warm_profiler(dev.type)
            ys1 = _tensors(y1)
            if not ys1:
                res["stages"]["runs"] = {"ok": False, "why": "forward returned no tensor"}
                return done()

            cal = spec.get("calibrate")
            if cal and spec.get("runtime", True):
                stage = "calibrate"
                res["stages"]["calibrate"] = calibrate(mod, cal, build, dev, timing)
                if not res["stages"]["calibrate"]["ok"]:
                    return done()
                model, xs = build(0, 1)
                ys1 = _tensors(model(*xs))

            stage = "deterministic"
            model2, xs2 = build(0, 1)
            ys2 = _tensors(model2(*xs2))
            same = len(ys1) == len(ys2) and all(
                a.shape == b.shape and bool(torch.equal(a.nan_to_num(), b.nan_to_num())) for a, b in zip(ys1, ys2, strict=True))
            res["stages"]["deterministic"] = {"ok": same} if same else {
                "ok": False, "why": "two runs with the same seeds gave different outputs"}
            if not same:
                return done()

            stage = "nontrivial"
            why = None
            for y in ys1:
                yf = y.float()
                if not bool(torch.isfinite(yf).all()):
                    why = "the output holds NaN or Inf"
                elif yf.numel() > 1 and float(yf.std()) < 1e-6:
                    why = "the output is constant" if float(yf.abs().max()) > 0 else "the output is all zeros"
                elif yf.numel() == 1 and float(yf.abs()) == 0:
                    why = "the output is zero"
                if why:
                    break
            if why is None:
                _, xs3 = build(0, 2)
                ys3 = _tensors(model(*xs3))
                # the evaluator's own test (`distributions.barely_varies`, at its default
                # tolerance): a task whose outputs it flags cannot tell a constant from the answer
                if distributions.barely_varies([ys1, ys3], EvalOptions.atol, EvalOptions.rtol):
                    why = (f"the output barely varies with the input (within atol {EvalOptions.atol:g}, rtol "
                           f"{EvalOptions.rtol:g} across two draws of get_inputs()): a constant would pass its trials")
            res["stages"]["nontrivial"] = {"ok": why is None, **({"why": why} if why else {})}
            if why:
                return done()

            window = spec.get("runtime_range") if spec.get("runtime", True) else None
            if window and spec.get("compile", True):
                stage = "runtime"
                lo, hi = float(window[0]), float(window[1])
                cal_st = res["stages"].get("calibrate") or {}
                est = cal_st["quick_eager_ms"] if cal_st.get("final_size_timed") else quick_eager_ms(model, xs, dev, timing)
                if est < lo / EARLY_REJECT_FACTOR or est > hi * EARLY_REJECT_FACTOR:
                    res["stages"]["runtime"] = {"ok": False, "early": True, "quick_eager_ms": round(est, 4), "why": (
                        f"eager takes about {est:.3f} ms (quick timing, before torch.compile), "
                        f"outside [{lo}, {hi}] ms")}
                    return done()

            compiled = None
            if spec.get("compile", True):
                stage = "compile"
                t0 = time.perf_counter()
                compiled = torch.compile(model)
                yc = _tensors(compiled(*xs))
                close = len(yc) == len(ys1) and all(
                    a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2))
                    for a, b in zip(ys1, yc, strict=True))
                res["stages"]["compile"] = {"ok": close, "seconds": round(time.perf_counter() - t0, 3),
                                            **({} if close else {"why": "torch.compile's output differs from eager"})}
                if not close:
                    return done()

            if spec.get("runtime", True):
                stage = "runtime"
                p = timing.Protocol(**spec.get("protocol", {}))
                sets = [xs, xs3]
                subjects: dict[str, Any] = {"eager": model}
                if compiled is not None:
                    subjects["compile"] = compiled
                with exclusive_device():
                    m = timing.measure(subjects, sets, dev.type, p)
                res["eager_ms"] = round(m["eager"].summary()["device"]["median_us"] / 1e3, 4)
                if compiled is not None:
                    res["compile_ms"] = round(m["compile"].summary()["device"]["median_us"] / 1e3, 4)
                res["stages"]["runtime"] = {"ok": True, "eager_ms": res["eager_ms"]}
    except BaseException as exc:
        res["stages"][stage] = {"ok": False, "why": f"{type(exc).__name__}: {exc}"[:600],
                                "traceback": traceback.format_exc(limit=4)[-1500:]}
    return done()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
