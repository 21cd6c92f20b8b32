"""Candidate process: imports `model_new.py` and the built extension, runs the trials.

`python -m cuda_agent.evaluator.candidate SPEC.json` runs inside the sandbox with only
its run directory writable. `... SPEC.json --wait DEVICE IDLE_S` is a process started
ahead of its job (see `warm`): it imports torch (on CUDA at once, on the CPU after the
go), creates the CUDA context and starts the profiler once (its first start costs
seconds; both after the go), all with no candidate code in it, then waits up to IDLE_S
seconds for SPEC.json to appear and runs it like the first form. It never sees the expected outputs: it writes each trial's
outputs (and what the runtime guards saw) to `out/`, and the trusted parent compares.
Files here are read by the parent with `torch.load(weights_only=True)` and plain JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_progress_path: Path | None = None
_t_start = time.perf_counter()
_phases: dict[str, float] = {}  # phase -> seconds since process start when it began


def _progress(phase: str, **extra: Any) -> None:
    key = phase if "trial" not in extra else f"{phase} {extra['trial']}"
    _phases[key] = round(time.perf_counter() - _t_start, 4)
    if _progress_path is not None:
        _progress_path.write_text(json.dumps({"phase": phase, **extra}))


def _load_extension(name: str, path: str) -> Any:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def _storage_span(t: Any) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def _same(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _forward_watching_streams(model: Any, inputs: list[Any], g: Any, modules: list[Any]) -> tuple[Any, dict[str, Any]]:
    """Run one forward under the CUDA profiler and report kernels that ran on another stream.

    A marker kernel launched on the current stream first tells which stream id that is.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cuda_agent.evaluator import guards

    info: dict[str, Any] = {"foreign": [], "kernels": []}
    marker = torch.empty(1, device="cuda")
    try:
        prof_ctx = profile(activities=[ProfilerActivity.CUDA])
        prof_ctx.__enter__()
    except Exception as exc:  # no CUPTI: the check is skipped and said so
        info["unavailable"] = f"{type(exc).__name__}: {exc}"[:300]
        return guards.call_guarded(model, inputs, g, modules), info
    try:
        marker.fill_(1.0)
        torch.cuda.synchronize()
        result = guards.call_guarded(model, inputs, g, modules)
        torch.cuda.synchronize()
    finally:
        prof_ctx.__exit__(None, None, None)
    try:
        events = [e for e in prof_ctx.events() if getattr(e.device_type, "name", "") == "CUDA"]
    except Exception as exc:
        info["unavailable"] = f"{type(exc).__name__}: {exc}"[:300]
        return result, info
    fill = next((e for e in events if "fill" in e.name.lower()), None)
    if fill is None:
        info["unavailable"] = "marker kernel not seen by the profiler"
        return result, info
    current = fill.device_resource_id
    info["current_stream"] = current
    for e in events:
        if e is fill:
            continue
        info["kernels"].append(f"{e.name[:80]}@{e.device_resource_id}")
        if e.device_resource_id != current:
            info["foreign"].append(f"{e.name[:60]} on stream {e.device_resource_id}")
    return result, info


def warm_host(device: str) -> None:
    """What a candidate process does before its job that touches only the host: beside a
    measurement on the GPU it may run (see `warm`); on the CPU it would not, so there it
    is left to the device stage."""
    if device == "cuda":
        _imports()


def _imports() -> None:
    import torch  # noqa: F401

    from cuda_agent.evaluator import guards, tensors, timing  # noqa: F401  (timing binds its clocks)
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def warm_device(device: str) -> None:
    """The rest of what a candidate process does before its job is known."""
    _imports()
    if device == "cuda":
        import torch

        from cuda_agent.evaluator import timing

        torch.cuda.init()
        timing.warm_profiler(device)


def main(spec_path: str) -> int:
    global _progress_path
    spec = json.loads(Path(spec_path).read_text())
    run_dir = Path(spec["run_dir"])
    out = run_dir / "out"
    _progress_path = out / "progress.json"
    report: dict[str, Any] = {"trials": [], "ok": False}

    def finish(**fields: Any) -> int:
        _progress("done")
        report.update(fields, phases_s=_phases)
        (out / "report.json").write_text(json.dumps(report))
        return 0

    try:
        _progress("import torch")
        import torch  # noqa: F401  (imported before any candidate code)

        # timing binds its clocks here, before any candidate code
        from cuda_agent.evaluator import guards, rules, timing
        from cuda_agent.evaluator.tensors import describe, seed_all, tensors, to_device, tree_map

        device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.init()
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        prof_spec = spec.get("profile")
        reference_model: Any = None
        if prof_spec:
            # The task's Model class is defined from the trusted copy before candidate code runs.
            from cuda_agent.tasks import import_task_module, task_from_code

            task = task_from_code(Path(prof_spec["task_path"]).read_text(), name="task",
                                  source=prof_spec["task_path"])
            reference_model = import_task_module(task).Model
        inputs_dir = Path(spec["inputs_dir"])
        modules = []
        _progress("load extension")
        for ext in spec["extensions"]:
            try:
                modules.append(_load_extension(ext["name"], ext["so_path"]))
            except Exception as exc:
                return finish(error="runtime", phase="load extension",
                              message=f"the built extension {ext['name']} failed to load: {type(exc).__name__}: {exc}")
        if spec["format"] == "single_file":
            import torch.utils.cpp_extension as ce

            by_name = {m.__name__: m for m in modules}

            def prebuilt(name: str, *args: Any, **kwargs: Any) -> Any:
                if name not in by_name:
                    raise RuntimeError(f"load_inline(name={name!r}) was not seen at build time")
                return by_name[name]

            ce.load_inline = prebuilt  # type: ignore[assignment]
            ce.load = prebuilt  # type: ignore[assignment]

        _progress("import model_new.py")
        sys.path.insert(0, str(run_dir))
        try:
            import model_new  # type: ignore[import-not-found]
        except BaseException as exc:
            return finish(error="runtime", phase="import model_new.py",
                          message=f"model_new.py failed to import: {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(limit=6)[-3000:])
        ModelNew = getattr(model_new, "ModelNew", None)
        if not isinstance(ModelNew, type) or not issubclass(ModelNew, torch.nn.Module):
            return finish(error="rejected", rule=rules.MISSING_MODELNEW,
                          message="model_new.py defines no class ModelNew(nn.Module).")

        _progress("wait for reference inputs")
        while not (inputs_dir / "ready").exists():
            if (inputs_dir / "failed").exists():
                return finish(error="reference", message="the reference Model failed")
            time.sleep(0.005)
        _progress("ModelNew(*get_init_inputs())")
        init_inputs = torch.load(inputs_dir / "init_inputs.pt", weights_only=True)
        seed_all(spec["init_seed"])
        try:
            model = ModelNew(*init_inputs).eval().to(device)
        except BaseException as exc:
            return finish(error="runtime", phase="ModelNew.__init__",
                          message=f"ModelNew(*get_init_inputs()) raised {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(limit=6)[-3000:])
        state = torch.load(inputs_dir / "state_dict.pt", weights_only=True)
        mine = model.state_dict()
        missing = sorted(set(state) - set(mine))
        unexpected = sorted(set(mine) - set(state))
        shapes = [f"{k}: reference {list(state[k].shape)}, ModelNew {list(mine[k].shape)}"
                  for k in sorted(set(state) & set(mine)) if state[k].shape != mine[k].shape]
        if missing or unexpected or shapes:
            parts = []
            if missing:
                parts.append(f"missing in ModelNew: {', '.join(missing[:8])}")
            if unexpected:
                parts.append(f"not in Model: {', '.join(unexpected[:8])}")
            if shapes:
                parts.append("shape mismatch: " + "; ".join(shapes[:4]))
            return finish(error="incorrect", rule=rules.PARAMETERS,
                          message="ModelNew's parameters do not match Model's state_dict (" + "; ".join(parts)
                          + "). Keep the same parameters and buffers, with the same names and shapes.")
        model.load_state_dict(state, strict=True)

        for k in range(spec["trials"]):
            _progress("trial", trial=k + 1)
            cpu_inputs = torch.load(inputs_dir / f"inputs_{k}.pt", weights_only=True)
            inputs = to_device(cpu_inputs, device)
            pristine = tree_map(inputs, lambda t: t.clone())
            g = guards.GuardReport()
            trial: dict[str, Any] = {"trial": k + 1}
            report["trials"].append(trial)
            t0 = time.perf_counter()
            try:
                if device.type == "cuda" and k == 0:
                    result, trial["streams"] = _forward_watching_streams(model, inputs, g, modules)
                else:
                    result = guards.call_guarded(model, inputs, g, modules)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except BaseException as exc:
                trial["guard"] = g.first_violation()
                trial["exception"] = f"{type(exc).__name__}: {exc}"[:3000]
                trial["traceback"] = traceback.format_exc(limit=6)[-3000:]
                return finish(error="forward")
            trial["forward_s"] = time.perf_counter() - t0
            trial["guard"] = g.first_violation()
            trial["extension_calls"] = g.extension_calls
            trial["ops"] = g.ops_seen
            trial["structure"] = describe(result)
            in_spans = [(p, _storage_span(t)) for p, t in tensors(inputs, "input")]
            aliases = []
            for p, t in tensors(result):
                lo, hi = _storage_span(t)
                for ip, (ilo, ihi) in in_spans:
                    if lo < ihi and ilo < hi and hi > lo:
                        aliases.append(f"{p} shares memory with {ip}")
            trial["aliases"] = aliases
            mutated = [p for (p, a), (_, b) in zip(tensors(inputs, "input"), tensors(pristine, "input"), strict=True)
                       if not _same(a, b)]
            trial["mutated_inputs"] = mutated
            exact = all(type(t) is torch.Tensor for _, t in tensors(result))
            trial["exact_types"] = exact
            if exact:
                torch.save(tree_map(result, lambda t: t.detach().to("cpu").clone()), out / f"out_{k}.pt")
            (out / "report.json").write_text(json.dumps(report))
            streams = trial.get("streams") or {}
            if streams.get("foreign"):
                trial["guard"] = (rules.STREAM,
                                  f"kernels ran on a stream other than the current one ({', '.join(streams['foreign'][:3])}); "
                                  "launch all work on c10::cuda::getCurrentCUDAStream() so callers can wait for it.")
            if trial["guard"] or aliases or mutated or not exact or g.extension_calls == 0:
                return finish(error="checks")
            del result, inputs, pristine
        if prof_spec:
            report["verified"] = True
            (out / "report.json").write_text(json.dumps(report))
            _progress("waiting for the device")
            go = Path(prof_spec["gate_dir"])
            deadline = time.monotonic() + float(prof_spec.get("gate_timeout_s", 600))
            while not (go / "go").exists():
                if (go / "cancel").exists() or time.monotonic() > deadline:
                    return finish(ok=True, profile_skipped=True)
                time.sleep(0.005)
            _progress("profile")
            t_p = time.perf_counter()
            seed_all(spec["init_seed"])
            eager = reference_model(*torch.load(inputs_dir / "init_inputs.pt", weights_only=True)).eval().to(device)
            eager.load_state_dict(torch.load(inputs_dir / "state_dict.pt", weights_only=True), strict=True)
            sets = [to_device(torch.load(inputs_dir / f"inputs_{k}.pt", weights_only=True), device)
                    for k in range(spec["trials"])]
            spent: dict[str, float] = {}
            res = timing.measure({"candidate": model, "eager": eager}, sets, device.type,
                                 timing.Protocol(**prof_spec["protocol"]), keep_outputs=["candidate"], spent_s=spent,
                                 probe=True, loose=["eager"])
            for k, o in res["candidate"].outputs.items():
                torch.save(tree_map(o, lambda t: t.detach().to("cpu").clone()), out / f"timed_{k}.pt")
            report["profile"] = {name: m.summary() for name, m in res.items()}
            report["profile"]["timed_outputs"] = sorted(res["candidate"].outputs)
            report["profile"]["threads"] = torch.get_num_threads()
            report["profile"]["seconds"] = time.perf_counter() - t_p
            report["profile"]["measure_s"] = spent
        return finish(ok=True)
    except BaseException as exc:
        return finish(error="runtime", phase="evaluator", message=f"{type(exc).__name__}: {exc}"[:3000],
                      traceback=traceback.format_exc(limit=8)[-3000:])


def _entry(argv: list[str]) -> int:
    global _t_start
    if len(argv) == 4 and argv[1] == "--wait":
        from cuda_agent.evaluator.waiting import wait_as_spare

        stages = wait_as_spare(argv, warm_host, warm_device)  # (in the run directory, its cwd)
        if stages is None:
            return 0  # nobody came: a spare that was not needed
        _t_start = time.perf_counter()  # phases count from the job's arrival
        _phases.update(stages)
    return main(argv[0])


if __name__ == "__main__":
    rc = _entry(sys.argv[1:])
    # Its report is written and closed: skip the interpreter's and CUDA's teardown
    # (destructors of every tensor, the context), most of a second on the GPU, which
    # the evaluator would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
