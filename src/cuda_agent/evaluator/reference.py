"""Reference process: runs the task's `Model` alone, with no candidate code in it.

`python -m cuda_agent.evaluator.reference SPEC.json` writes, for the candidate process,
the init inputs, the reference state_dict and each trial's inputs (`shared/`; the task's
own trials and those on other distributions, see `distributions`), and keeps each
trial's expected outputs where the candidate cannot see them (`private/`; see
`protocol` for the files and records, `child` for the spare form). A distribution trial
the task is not defined on is skipped, and the report says why. Because the reference
never runs in the candidate's process, nothing the reference computed can be recovered
from uninitialised memory there.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cuda_agent.evaluator import child, distributions
from cuda_agent.evaluator import protocol as P


def main(spec_path: Path, spare_stages: dict[str, float]) -> int:
    spec = P.ReferenceSpec.read(spec_path)
    if spec is None:
        return 1  # the parent wrote it: never happens, and the parent reports no report
    run = P.RunLayout(Path(spec.work))
    P.write_marker(run.private / P.STARTED)  # the job reached this process (see `warm`)
    t0 = time.perf_counter()
    phase = "import torch"
    phases: dict[str, float] = {}  # phase -> seconds since the process's start when it began

    def begin(name: str) -> str:
        phases[name] = round(time.perf_counter() - t0, 4)
        return name

    try:
        import torch

        from cuda_agent.evaluator.tensors import describe, seed_all, to_device
        from cuda_agent.tasks import import_task_module, task_from_code

        device = torch.device("cuda" if spec.device == "cuda" else "cpu")
        if device.type == "cuda":
            phase = begin("CUDA init")
            torch.cuda.init()
            torch.empty(1, device=device)  # the context, so the phases below are the task's
        phase = begin("import task")
        code = run.task_code.read_text()
        task = task_from_code(code, name=spec.task_name, source=str(run.task_code))
        mod = import_task_module(task)
        phase = begin("get_init_inputs")
        seed_all(spec.init_seed)
        init_inputs = _as_list(mod.get_init_inputs())
        torch.save(init_inputs, run.init_inputs)
        phase = begin("Model(*get_init_inputs())")
        seed_all(spec.init_seed)
        model = mod.Model(*init_inputs).eval().to(device)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, run.state_dict)
        structures: list[Any] = []
        all_inputs = []
        kinds = spec.distributions or [distributions.TASK] * len(spec.seeds)
        for k, (seed, kind) in enumerate(zip(spec.seeds, kinds, strict=True)):
            phase = f"get_inputs (trial {k + 1}{'' if kind == distributions.TASK else ', ' + kind})"
            inputs = distributions.make_inputs(mod.get_inputs, seed, kind)
            _check_inputs(inputs, torch.Tensor)
            torch.save(inputs, run.inputs(k))
            all_inputs.append(inputs)
        P.write_marker(run.shared / P.READY)  # the candidate waits for this before its trials
        begin("inputs ready")
        skipped: dict[str, str] = {}
        own: list[Any] = []  # the task's own trials' outputs
        for k, (inputs, kind) in enumerate(zip(all_inputs, kinds, strict=True)):
            phase = begin(f"Model.forward (trial {k + 1})")
            if kind == distributions.TASK:
                with torch.no_grad():
                    out = model(*to_device(inputs, device))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                why = ""
            else:  # the task may not be defined there: then the trial is not judged (and says why)
                out, why = distributions.judged_output(model, to_device(inputs, device), own[0] if own else None)
            structures.append(describe(out) if out is not None else None)  # (where the task's Model puts it)
            if why:
                skipped[str(k)] = why
                continue
            out = to_device(out, torch.device("cpu"), detach=True)
            if kind == distributions.TASK:
                own.append(out)
            torch.save(out, run.expected(k))
        sets = [k for k in range(len(all_inputs)) if str(k) not in skipped]
        P.TimingSets(trials=sets).write(run.timing_sets)
        P.ReferenceReport(ok=True, structures=structures, seconds=time.perf_counter() - t0, phases_s=phases,
                          n_params=sum(p.numel() for p in model.parameters()), skipped=skipped, timing_sets=sets,
                          barely_varies=distributions.barely_varies(own, spec.atol, spec.rtol)).write(
                              run.reference_report)
        phase = "expected outputs of the vouched batches"
        _serve(run, model, [to_device(all_inputs[k], device) for k in sets], device, spec.serve_s)
        return 0
    except BaseException as exc:  # the task's own code failed: report it, whatever it was
        P.write_marker(run.shared / P.FAILED)
        P.ReferenceReport(ok=False, phase=phase, error=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc(limit=8)[-4000:]).write(run.reference_report)
        return 1


def _serve(run: P.RunLayout, model: Any, sets: list[list[Any]], device: Any, serve_s: float) -> None:
    """After the trials: wait (idle) for the parent's `ExpectRequest`, then compute the
    expected outputs of the vouched batches' checked calls, on the inputs `vouch`
    rebuilds from their seeds; or for `end`."""
    import torch

    from cuda_agent.evaluator import vouch
    from cuda_agent.evaluator.tensors import to_device

    deadline = time.monotonic() + serve_s
    while not (run.private / P.END).exists() and run.private.exists():
        request = P.ExpectRequest.read(run.expect_request) if run.expect_request.exists() else None
        if request is not None:
            buffers = [t.clone() if isinstance(t, torch.Tensor) else t for t in sets[0]]
            for call in request.calls:
                try:
                    vouch.vary_inputs(buffers, sets, int(call["seed"]), int(call["i"]))
                    with torch.no_grad():
                        out = model(*buffers)
                    torch.save(to_device(out, torch.device("cpu"), detach=True),
                               run.vouched_expected(int(call["b"]), int(call["i"])))
                except Exception:  # the task fails on these inputs: that call goes unchecked (and said so)
                    continue
            P.write_marker(run.private / P.EXPECTED)
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)


class TaskInputError(TypeError):
    """The task's get_inputs() returned something a model's inputs cannot be."""


def _check_inputs(inputs: list[Any], tensor: type) -> None:
    """Inputs are tensors and numbers (None, and lists, tuples and dicts of those, too): what
    the candidate's process can load without running pickled code and a kernel can take."""

    def walk(x: Any, where: str) -> None:
        if x is None or isinstance(x, (tensor, bool, int, float, complex)):
            return
        if isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")
            return
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            for k, v in x.items():
                walk(v, f"{where}[{k!r}]")
            return
        raise TaskInputError(f"the task's get_inputs() returned a {type(x).__module__}.{type(x).__qualname__} "
                             f"at {where}; a model's inputs must be tensors and numbers")

    walk(inputs, "get_inputs()")


def _as_list(values: Any) -> list[Any]:
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _imports() -> None:
    import torch  # noqa: F401

    from cuda_agent.evaluator import tensors, vouch  # noqa: F401
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def _context() -> None:
    import torch

    torch.empty(1, device="cuda")


WARMUP = child.Warmup(imports=_imports, cuda=_context)

if __name__ == "__main__":
    child.run(sys.argv[1:], main, WARMUP)
