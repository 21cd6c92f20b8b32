"""Candidate process: imports `model_new.py` and the built extension, runs the trials.

`python -m cuda_agent.evaluator.candidate SPEC.json` runs inside the sandbox with only
its run directory writable (see `protocol` for the files and records, `child` for the
spare form). A spare imports torch, creates the CUDA context and starts the profiler once
(its first start costs seconds) with no candidate code in it. It never sees the expected
outputs: it writes each trial's outputs (and what the runtime guards saw) to `out/`, and
the trusted parent compares. Files here are read by the parent with
`torch.load(weights_only=True)` and as `protocol` records.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cuda_agent.evaluator import child
from cuda_agent.evaluator import protocol as P

_t_start = time.perf_counter()
_phases: dict[str, float] = {}  # phase -> seconds since the job's start when it began


_progress_path: Path | None = None


def _progress(phase: str, trial: int | None = None) -> None:
    """Where the process is, for the parent's messages (`protocol.Progress`)."""
    _phases[phase if trial is None else f"{phase} {trial}"] = round(time.perf_counter() - _t_start, 4)
    if _progress_path is not None:
        P.Progress(phase=phase, trial=trial).write(_progress_path)


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


def main(spec_path: Path, spare_stages: dict[str, float]) -> int:
    global _progress_path, _t_start
    if spare_stages:
        _t_start = time.perf_counter()  # phases count from the job's arrival
        _phases.update(spare_stages)
    spec = P.CandidateSpec.read(spec_path)
    if spec is None:
        return 1  # the parent wrote it: never happens, and the parent reports no report
    run = P.RunLayout(Path(spec.work))
    _progress_path = run.progress
    report = P.CandidateReport()

    def finish(**fields: Any) -> int:
        _progress("done")
        for k, v in fields.items():
            setattr(report, k, v)
        report.phases_s = _phases
        report.write(run.candidate_report)
        P.write_marker(run.out / P.DEVICE_FREE)
        return 0

    try:
        _progress("import torch")
        import torch  # noqa: F401  (imported before any candidate code)

        # timing binds its clocks here, before any candidate code
        from cuda_agent.evaluator import guards, rules, timing, vouch
        from cuda_agent.evaluator.op_watch import Watch
        from cuda_agent.evaluator.tensors import describe, seed_all, tensors, to_device, tree_map

        watch = Watch(spec.watch_so)  # every ATen op from here on, on any thread (see op_watch)
        report.watch = watch.phases
        device = torch.device("cuda" if spec.device == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.init()
        if spec.threads:
            torch.set_num_threads(spec.threads)
        reference_model: Any = None
        if spec.profile:
            # The task's Model class is defined from the trusted copy before candidate code runs.
            from cuda_agent.tasks import import_task_module, task_from_code

            task = task_from_code(run.candidate_task_code.read_text(), name="task",
                                  source=str(run.candidate_task_code))
            reference_model = import_task_module(task).Model
        modules = []
        _progress("load extension")
        for ext in spec.extensions:
            try:
                with watch.candidate():
                    modules.append(_load_extension(ext.name, ext.so_path))
            except Exception as exc:
                return finish(error=P.ERROR_RUNTIME, phase="load extension",
                              message=f"the built extension {ext.name} failed to load: {type(exc).__name__}: {exc}")
        watch.close("loading the extension")
        if spec.format == "single_file":
            import torch.utils.cpp_extension as ce

            by_name = {m.__name__: m for m in modules}

            def prebuilt(name: str, *args: Any, **kwargs: Any) -> Any:
                if name not in by_name:
                    raise RuntimeError(f"load_inline(name={name!r}) was not seen at build time")
                return by_name[name]

            ce.load_inline = prebuilt  # type: ignore[assignment]
            ce.load = prebuilt  # type: ignore[assignment]

        _progress("import model_new.py")
        sys.path.insert(0, str(run.run))
        try:
            with watch.candidate():
                import model_new  # type: ignore[import-not-found]
        except BaseException as exc:
            return finish(error=P.ERROR_RUNTIME, phase="import model_new.py",
                          message=f"model_new.py failed to import: {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(limit=6)[-3000:])
        watch.close("import of model_new.py")
        ModelNew = getattr(model_new, "ModelNew", None)
        if not isinstance(ModelNew, type) or not issubclass(ModelNew, torch.nn.Module):
            return finish(error=P.ERROR_REJECTED, rule=rules.MISSING_MODELNEW,
                          message="model_new.py defines no class ModelNew(nn.Module).")

        _progress("wait for reference inputs")
        while not (run.shared / P.READY).exists():
            if (run.shared / P.FAILED).exists():
                return finish(error=P.ERROR_REFERENCE, message="the reference Model failed")
            time.sleep(0.005)
        _progress("ModelNew(*get_init_inputs())")
        init_inputs = torch.load(run.init_inputs, weights_only=True)
        seed_all(spec.init_seed)
        try:
            with watch.candidate():
                model = ModelNew(*init_inputs).eval().to(device)
        except BaseException as exc:
            return finish(error=P.ERROR_RUNTIME, phase="ModelNew.__init__",
                          message=f"ModelNew(*get_init_inputs()) raised {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(limit=6)[-3000:])
        state = torch.load(run.state_dict, weights_only=True)
        mismatch = _parameter_mismatch(state, model.state_dict())
        if mismatch:
            return finish(error=P.ERROR_INCORRECT, rule=rules.PARAMETERS,
                          message="ModelNew's parameters do not match Model's state_dict (" + mismatch
                          + "). Keep the same parameters and buffers, with the same names and shapes.")
        with watch.candidate():
            model.load_state_dict(state, strict=True)
        watch.close("__init__")
        call = watch.wrap(model)  # the candidate's calls, from here on

        for k in range(spec.trials):
            _progress("trial", trial=k + 1)
            # (held until the next trial's are loaded: consecutive trials' inputs never share
            # an address, so a cache keyed by data pointers cannot hit in the trials)
            # (on the GPU, mapped: the reference wrote them whole and never writes them again,
            # and they are only read, by the copy to the device)
            cpu_inputs = torch.load(run.inputs(k), weights_only=True, mmap=device.type == "cuda")
            inputs = to_device(cpu_inputs, device)
            g = guards.GuardReport()
            trial = P.TrialReport(trial=k + 1)
            report.trials.append(trial)
            t0 = time.perf_counter()
            try:
                if device.type == "cuda" and k == 0:
                    result, trial.streams = _forward_watching_streams(call, inputs, g, modules)
                else:
                    result = guards.call_guarded(call, inputs, g, modules)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except BaseException as exc:
                trial.guard = _guard(g)
                trial.exception = f"{type(exc).__name__}: {exc}"[:3000]
                trial.traceback = traceback.format_exc(limit=6)[-3000:]
                return finish(error=P.ERROR_FORWARD)
            trial.forward_s = time.perf_counter() - t0
            trial.guard = _guard(g)
            trial.extension_calls = g.extension_calls
            trial.ops = g.ops_seen
            trial.structure = describe(result)
            in_spans = [(p, _storage_span(t)) for p, t in tensors(inputs, "input")]
            for p, t in tensors(result):
                lo, hi = _storage_span(t)
                for ip, (ilo, ihi) in in_spans:
                    if lo < ihi and ilo < hi and hi > lo:
                        trial.aliases.append(f"{p} shares memory with {ip}")
            # the parent compares them with what the reference wrote (a mutation is its to see)
            torch.save(tree_map(inputs, lambda t: t.detach().to("cpu").clone()), run.inputs_after(k))
            trial.exact_types = all(type(t) is torch.Tensor for _, t in tensors(result))
            if trial.exact_types:
                torch.save(tree_map(result, lambda t: t.detach().to("cpu").clone()), run.output(k))
            report.write(run.candidate_report)
            if trial.streams.get("foreign"):
                trial.guard = [rules.STREAM,
                               f"kernels ran on a stream other than the current one "
                               f"({', '.join(trial.streams['foreign'][:3])}); launch all work on "
                               "c10::cuda::getCurrentCUDAStream() so callers can wait for it."]
            watch.close(f"trial {k + 1}")
            if trial.guard or trial.aliases or not trial.exact_types or g.extension_calls == 0:
                return finish(error=P.ERROR_CHECKS)
            del result, inputs
        if spec.profile:
            report.verified = True
            report.write(run.candidate_report)
            _progress("waiting for the device")
            P.write_marker(run.out / P.DEVICE_FREE)
            go, cancel = run.gate / P.GO, run.gate / P.CANCEL
            if not child.wait_for([go, cancel], time.monotonic() + spec.profile.gate_timeout_s) \
                    or not go.exists():
                return finish(ok=True, profile_skipped=True)
            _progress("profile")
            t_p = time.perf_counter()
            seed_all(spec.init_seed)
            eager = reference_model(*torch.load(run.init_inputs, weights_only=True)).eval().to(device)
            eager.load_state_dict(torch.load(run.state_dict, weights_only=True), strict=True)
            order = _timing_sets(run, spec.trials, time.monotonic() + spec.profile.gate_timeout_s)
            sets = [to_device(torch.load(run.inputs(k), weights_only=True, mmap=device.type == "cuda"), device)
                    for k in order]
            spent: dict[str, float] = {}
            res = timing.measure({"candidate": call, "eager": eager}, sets, device.type,
                                 timing.Protocol(**spec.profile.protocol), keep_outputs=["candidate"],
                                 spent_s=spent, probe=True, loose=["eager"])
            for pos, o in res["candidate"].outputs.items():
                torch.save(tree_map(o, lambda t: t.detach().to("cpu").clone()), run.timed_output(order[pos]))
            summaries = {name: m.summary() for name, m in res.items()}
            report.profile = P.ProfileReport(
                candidate=summaries["candidate"], eager=summaries["eager"], probe=summaries.get(timing.PROBE),
                timed_outputs=sorted(order[pos] for pos in res["candidate"].outputs), threads=torch.get_num_threads(),
                seconds=time.perf_counter() - t_p, measure_s=spent)
            watch.close("timing")
            report.write(run.candidate_report)
            del res, eager
            # The batches the parent times itself (see `vouch`): until it says "end".
            _progress("vouched batches")

            def save(b: int, i: int, out: Any) -> None:
                torch.save(tree_map(out, lambda t: t.detach().to("cpu").clone()), run.vouched_output(b, i))

            report.vouch_end = vouch.Serve(run.cmd, run.reply).run(call, sets, device, save,
                                                                   spec.profile.gate_timeout_s)
            watch.close("vouched batches")
        return finish(ok=True)
    except BaseException as exc:
        return finish(error=P.ERROR_RUNTIME, phase="evaluator", message=f"{type(exc).__name__}: {exc}"[:3000],
                      traceback=traceback.format_exc(limit=8)[-3000:])


def _timing_sets(run: P.RunLayout, trials: int, deadline: float) -> list[int]:
    """The trials whose inputs the timed calls use, as the reference wrote them once its
    outputs were computed (the parent checks them against the reference's own list)."""
    while time.monotonic() < deadline and not (run.shared / P.FAILED).exists():
        sets = P.TimingSets.read(run.timing_sets) if run.timing_sets.exists() else None
        if sets is not None and sets.trials and all(0 <= k < trials for k in sets.trials):
            return sets.trials
        time.sleep(0.005)
    return list(range(trials))


def _guard(g: Any) -> list[str] | None:
    first = g.first_violation()
    return list(first) if first else None


def _parameter_mismatch(state: dict[str, Any], mine: dict[str, Any]) -> str:
    """What differs between the reference's state_dict and ModelNew's, in words; "" if nothing."""
    missing = sorted(set(state) - set(mine))
    unexpected = sorted(set(mine) - set(state))
    shapes = [f"{k}: reference {list(state[k].shape)}, ModelNew {list(mine[k].shape)}"
              for k in sorted(set(state) & set(mine)) if state[k].shape != mine[k].shape]
    parts = []
    if missing:
        parts.append(f"missing in ModelNew: {', '.join(missing[:8])}")
    if unexpected:
        parts.append(f"not in Model: {', '.join(unexpected[:8])}")
    if shapes:
        parts.append("shape mismatch: " + "; ".join(shapes[:4]))
    return "; ".join(parts)


def _imports() -> None:
    import torch  # noqa: F401

    from cuda_agent.evaluator import guards, tensors, timing, vouch  # noqa: F401  (they bind their clocks)
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def _warm_profiler() -> None:
    from cuda_agent.evaluator import timing

    timing.warm_profiler("cuda")


WARMUP = child.Warmup(imports=_imports, cuda=_warm_profiler)

if __name__ == "__main__":
    child.run(sys.argv[1:], main, WARMUP)
