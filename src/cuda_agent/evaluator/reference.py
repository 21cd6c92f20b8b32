"""Reference process: runs the task's `Model` alone, with no candidate code in it.

`python -m cuda_agent.evaluator.reference SPEC.json` writes, for the candidate process,
the init inputs, the reference state_dict and each trial's inputs (`shared_dir`), and
keeps each trial's expected outputs where the candidate cannot see them
(`private_dir`). Because the reference never runs in the candidate's process, nothing
the reference computed can be recovered from uninitialised memory there.

`... SPEC.json --wait DEVICE IDLE_S` starts ahead of its job (see `warm`): torch (on
CUDA at once, on the CPU after the go) and the CUDA context (after the go) first, then up
to IDLE_S seconds of waiting for SPEC.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def warm_host(device: str) -> None:
    """Before its job, what touches only the host (on CUDA; see `candidate.warm_host`)."""
    if device == "cuda":
        _imports()


def _imports() -> None:
    import torch  # noqa: F401

    from cuda_agent.evaluator import tensors  # noqa: F401
    from cuda_agent.tasks import import_task_module, task_from_code  # noqa: F401


def warm_device(device: str) -> None:
    _imports()
    if device == "cuda":
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    shared = Path(spec["shared_dir"])
    private = Path(spec["private_dir"])
    status_file = private / "reference.json"
    (private / "started").write_text("")  # the job reached this process (see `warm`)
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

        device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
        if device.type == "cuda":
            phase = begin("CUDA init")
            torch.cuda.init()
            torch.empty(1, device=device)  # the context, so the phases below are the task's
        phase = begin("import task")
        code = Path(spec["task_path"]).read_text()
        task = task_from_code(code, name=spec.get("task_name", "task"), source=spec["task_path"])
        mod = import_task_module(task)
        phase = begin("get_init_inputs")
        seed_all(spec["init_seed"])
        init_inputs = mod.get_init_inputs()
        if not isinstance(init_inputs, (list, tuple)):
            init_inputs = [init_inputs]
        init_inputs = list(init_inputs)
        torch.save(init_inputs, shared / "init_inputs.pt")
        phase = begin("Model(*get_init_inputs())")
        seed_all(spec["init_seed"])
        model = mod.Model(*init_inputs).eval().to(device)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, shared / "state_dict.pt")
        structures: list[Any] = []
        all_inputs = []
        for k, seed in enumerate(spec["seeds"]):
            phase = f"get_inputs (trial {k + 1})"
            seed_all(seed)
            inputs = mod.get_inputs()
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            inputs = list(inputs)
            torch.save(inputs, shared / f"inputs_{k}.pt")
            all_inputs.append(inputs)
        # The candidate process waits for this before it starts its trials.
        (shared / "ready.tmp").write_text("ready")
        os.replace(shared / "ready.tmp", shared / "ready")
        begin("inputs ready")
        for k, inputs in enumerate(all_inputs):
            phase = begin(f"Model.forward (trial {k + 1})")
            with torch.no_grad():
                out = model(*to_device(inputs, device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            structures.append(describe(out))
            torch.save(to_device(out, torch.device("cpu"), detach=True), private / f"expected_{k}.pt")
        status_file.write_text(json.dumps({
            "ok": True, "structures": structures, "seconds": time.perf_counter() - t0, "phases_s": phases,
            "n_params": sum(p.numel() for p in model.parameters()),
        }))
        return 0
    except BaseException as exc:  # the task's own code failed: report it, whatever it was
        tb = traceback.format_exc(limit=8)
        (shared / "failed").write_text("failed")
        status_file.write_text(json.dumps({
            "ok": False, "phase": phase, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:],
        }))
        return 1


def _entry(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--wait":
        from cuda_agent.evaluator.waiting import wait_as_spare

        if wait_as_spare(argv, warm_host, warm_device) is None:  # (in the private directory, its cwd)
            return 0
    return main(argv[0])


if __name__ == "__main__":
    rc = _entry(sys.argv[1:])
    # Its status file is written and closed: skip the interpreter's and CUDA's teardown
    # (destructors of every tensor, the context), most of a second on the GPU, which
    # the evaluator would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
