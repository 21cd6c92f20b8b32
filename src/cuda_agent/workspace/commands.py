"""What `bash utils/compile.sh`, `python3 -m utils.verification` and `python3 -m utils.profiling`
run inside a workspace. Thin: each reads the workspace's solution files and hands them to the
trusted evaluator, which works on a clean copy.

Inside the agent's sandboxed shell the evaluator does not run in the sandbox at all: the
command sends its name and arguments over the Unix socket named by
`CUDA_AGENT_EVAL_SOCKET` to the agent's evaluation service, which runs the same command
outside, on the episode's workspace, and sends back the text and exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SOCKET_ENV = "CUDA_AGENT_EVAL_SOCKET"
COMMANDS = ("compile", "verification", "profiling")

Emit = Callable[[str], None]


def _workspace() -> Path:
    # The commands are run from the workspace root (`python3 -m utils.x`), as in the released layout.
    return Path(os.environ.get("CUDA_AGENT_WORKSPACE") or os.getcwd()).resolve()


def _no_sandbox() -> bool:
    return os.environ.get("CUDA_AGENT_NO_SANDBOX") == "1"


def _forward(name: str, argv: list[str] | None) -> int | None:
    """Run the command through the evaluation service when there is one; None if not."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    request = json.dumps({"command": name, "argv": list(argv if argv is not None else sys.argv[1:])})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(request.encode() + b"\n")
            chunks = []
            while True:
                data = s.recv(1 << 16)
                if not data:
                    break
                chunks.append(data)
        reply = json.loads(b"".join(chunks).decode())
    except (OSError, ValueError) as exc:
        print(f"[FAIL] the evaluation service did not answer ({type(exc).__name__}: {exc})")
        return 1
    sys.stdout.write(reply.get("output", ""))
    sys.stdout.flush()
    return int(reply.get("rc", 1))


def run_command(name: str, ws: Path, argv: list[str], emit: Emit, *, sandbox: bool = True,
                warm: bool = False, gpu_index: int | None = None) -> tuple[int, Any]:
    """Run one workspace command on `ws`; its text goes to `emit`. Returns the exit code
    and what the evaluator returned (a BuildResult or EvalResult, None on a usage error).
    `warm`: evaluations use and leave spare processes (a long-lived caller, the service);
    `gpu_index`: the GPU that verifies and times (default 0)."""
    if name not in COMMANDS:
        emit(f"unknown command {name!r}; the workspace commands are {', '.join(COMMANDS)}\n")
        return 2, None
    if name == "compile":
        return _compile(ws, argv, emit, sandbox)
    return {"verification": _verification, "profiling": _profiling}[name](ws, argv, emit, sandbox, warm,
                                                                         gpu_index)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{self.prog}: {message}")


def _compile(ws: Path, argv: list[str], emit: Emit, sandbox: bool) -> tuple[int, Any]:
    from cuda_agent.evaluator import build as B
    from cuda_agent.evaluator.solution import SolutionError, load_solution
    from cuda_agent.files import atomic_copy
    from cuda_agent.sandbox import SandboxConfig, SandboxUnavailable
    from cuda_agent.tasks import TaskError
    from cuda_agent.workspace import WorkspaceError, load_record

    _Parser(prog="utils/compile.sh", description=__doc__).parse_args(argv)
    t0 = time.perf_counter()
    try:
        rec = load_record(ws)
        sol = load_solution(ws)
        if sol.format == "single_file":
            emit("model_new.py builds its own extension with load_inline; nothing to compile here. "
                 "Run python3 -m utils.verification.\n")
            return 0, None
        spec = B.workspace_extension(sol, rec.device)
        opts = B.BuildOptions(device=rec.device, sandbox=SandboxConfig(enabled=sandbox))
        res = B.build_extension(spec, opts, str(ws))
    except (WorkspaceError, SolutionError, TaskError, SandboxUnavailable, RuntimeError) as exc:
        emit(f"Compilation failed: {exc}\n")
        return 1, None
    dt = time.perf_counter() - t0
    if not res.ok:
        emit("Compilation failed.\n" + res.message + "\n")
        emit(f"[TIME] Compilation took {dt:.2f}s\n")
        return 1, res
    target = ws / "cuda_extension.so"
    assert res.so_path is not None
    atomic_copy(res.so_path, target)
    what = "cached build" if res.cached else (
        f"recompiled {', '.join(r for r in res.rebuilt if not r.startswith('link'))}" if res.rebuilt else "up to date")
    emit(f"Compile success: cuda_extension.so ({what})\n")
    emit(f"[TIME] Compilation took {dt:.2f}s\n")
    return 0, res


def _options(rec: Any, ws: Path, sandbox: bool, profile: bool, warm: bool, seed: int | None = None,
             gpu_index: int | None = None) -> Any:
    from cuda_agent.evaluator.evaluate import EvalOptions

    gpu = {} if gpu_index is None or rec.device != "cuda" else {"gpu_index": gpu_index}
    return EvalOptions(device=rec.device, seed=seed, sandbox=sandbox, build_key=str(ws), profile=profile, warm=warm,
                       **gpu)


def prefetch(ws: Path, *, sandbox: bool = True, warm: bool = False, device_lock: Any = None) -> dict[str, Any]:
    """What the workspace's first profiling and first build would wait for, done ahead:
    the task's baselines measured and cached (with the options `utils.profiling` uses),
    then the precompiled torch headers the workspace's C++ sources use, where this
    toolchain has not built them yet (tens of seconds, once per machine and torch; the
    kinds side by side).
    Returns what happened to each ("baselines": "cached" / "measured" / "off" /
    "failed: ..."; "headers": "built: KINDS" / "cached" / "failed: KINDS" / "skipped: ...")
    and the seconds each took; never raises for a broken workspace. The baselines are
    measured holding `device_lock` (episodes sharing a device take turns)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuda_agent.evaluator import build as B
    from cuda_agent.evaluator.evaluate import prefetch_baselines
    from cuda_agent.tasks import TaskError
    from cuda_agent.workspace import WorkspaceError, load_record

    out: dict[str, Any] = {}
    try:
        rec = load_record(ws)
    except (WorkspaceError, TaskError) as exc:
        return {"baselines": f"failed: {exc}", "headers": f"skipped: {exc}"}
    t0 = time.perf_counter()
    try:
        with device_lock if device_lock is not None else contextlib.nullcontext():
            out["baselines"] = prefetch_baselines(rec.task, _options(rec, ws, sandbox, profile=True, warm=warm))
    except Exception as exc:  # a broken task: the first evaluation reports it
        out["baselines"] = f"failed: {type(exc).__name__}: {exc}"[:500]
    out["baselines_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    try:
        tc = B.toolchain(rec.device)
        # the kinds a kernel file or binding can include (torch/extension.h, torch/types.h)
        missing = [k for k in sorted(B.PCH_HEADERS) if not B.pch_built(tc, k)]
        # side by side (each is one long compiler process)
        failed: list[str] = []
        if missing:
            with ThreadPoolExecutor(len(missing)) as pool:
                failed = [k for k, h in zip(missing, pool.map(lambda k: B.ensure_pch(tc, k), missing), strict=True)
                          if h is None]
        out["headers"] = (f"failed: {', '.join(failed)}" if failed else
                          f"built: {', '.join(missing)}" if missing else "cached")
    except Exception as exc:  # no compiler: the first build says so
        out["headers"] = f"skipped: {type(exc).__name__}: {exc}"[:500]
    out["headers_s"] = round(time.perf_counter() - t0, 3)
    return out


def _evaluate(ws: Path, argv: list[str], emit: Emit, sandbox: bool, prog: str, profile: bool,
              warm: bool = False, gpu_index: int | None = None) -> tuple[int, Any]:
    from cuda_agent.evaluator.evaluate import evaluate
    from cuda_agent.evaluator.solution import SolutionError, load_solution
    from cuda_agent.sandbox import SandboxUnavailable
    from cuda_agent.tasks import TaskError
    from cuda_agent.workspace import WorkspaceError, load_record

    ap = _Parser(prog=prog)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        rec = load_record(ws)
        sol = load_solution(ws)
        res = evaluate(rec.task, sol, _options(rec, ws, sandbox, profile, warm, args.seed, gpu_index))
    except (WorkspaceError, SolutionError, TaskError, SandboxUnavailable) as exc:
        emit(f"[FAIL] {exc}\n")
        return 1, None
    if not res.correct:
        emit(f"[FAIL] {res.status}" + (f" ({res.rule})" if res.rule else "") + "\n")
        emit(res.message + "\n")
        return 1, res
    return 0, res


def _verification(ws: Path, argv: list[str], emit: Emit, sandbox: bool, warm: bool = False,
                  gpu_index: int | None = None) -> tuple[int, Any]:
    rc, res = _evaluate(ws, argv, emit, sandbox, "python3 -m utils.verification", profile=False, warm=warm,
                        gpu_index=gpu_index)
    if rc == 0:
        for t in res.trial_inputs:
            inputs = f" (inputs: {t['distribution']} distribution)" if t["distribution"] else ""
            if t["skipped"]:
                emit(f"[SKIP] check {t['trial']}/{res.trials}{inputs}: {t['skipped']}\n")
            else:
                emit(f"[PASS] check {t['trial']}/{res.trials}{inputs}\n")
        emit("[PASS] verify success\n")
    return rc, res


def _profiling(ws: Path, argv: list[str], emit: Emit, sandbox: bool, warm: bool = False,
               gpu_index: int | None = None) -> tuple[int, Any]:
    """Verify, then time the solution against eager PyTorch and torch.compile."""
    rc, res = _evaluate(ws, argv, emit, sandbox, "python3 -m utils.profiling", profile=True, warm=warm,
                        gpu_index=gpu_index)
    if rc != 0:
        return rc, res
    unit = "device time" if res.device == "cuda" else "time"
    names = {"candidate": "Your kernels (model_new.py)", "eager": "Torch eager", "compile": "torch.compile"}
    for key, label in names.items():
        t = res.times_us.get(key)
        if t:
            emit(f"{label:30s} {unit} median {t['median_us']:.2f} us "
                 f"(min {t['min_us']:.2f}, max {t['max_us']:.2f}, {int(t['iterations'])} runs)\n")
    if res.speedup_vs_eager is not None:
        emit(f"Speedup vs torch eager:    {res.speedup_vs_eager:.3f}x\n")
        emit(f"Speedup vs torch.compile:  {res.speedup_vs_compile:.3f}x\n")
        emit(f"Reward ({res.reward_name}): {res.reward:g}\n")
    else:
        emit(res.message + "\n")
    if res.flags:
        emit("Flags: " + ", ".join(res.flags) + "\n")
    return 0, res


def _main(name: str, argv: list[str] | None) -> int:
    rc = _forward(name, argv)
    if rc is not None:
        return rc

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        return run_command(name, _workspace(), list(argv if argv is not None else sys.argv[1:]), emit,
                           sandbox=not _no_sandbox())[0]
    except ValueError as exc:  # a usage error
        print(exc, file=sys.stderr)
        return 2


def compile_main(argv: list[str] | None = None) -> int:
    return _main("compile", argv)


def verification_main(argv: list[str] | None = None) -> int:
    return _main("verification", argv)


def profiling_main(argv: list[str] | None = None) -> int:
    return _main("profiling", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(compile_main())
