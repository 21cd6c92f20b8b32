"""What `bash utils/compile.sh`, `python3 -m utils.verification` and `python3 -m utils.profiling`
run inside a workspace. Thin: each reads the workspace's solution files and hands them to the
trusted evaluator, which works on a clean copy."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from cuda_agent.evaluator import build as B
from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
from cuda_agent.evaluator.solution import SolutionError, load_solution
from cuda_agent.sandbox import SandboxConfig, SandboxUnavailable
from cuda_agent.tasks import TaskError
from cuda_agent.workspace import WorkspaceError, load_record


def _workspace() -> Path:
    # The commands are run from the workspace root (`python3 -m utils.x`), as in the released layout.
    return Path(os.environ.get("CUDA_AGENT_WORKSPACE") or os.getcwd()).resolve()


def _no_sandbox() -> bool:
    return os.environ.get("CUDA_AGENT_NO_SANDBOX") == "1"


def compile_main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="utils/compile.sh", description=__doc__).parse_args(argv)
    ws = _workspace()
    t0 = time.perf_counter()
    try:
        rec = load_record(ws)
        sol = load_solution(ws)
        if sol.format == "single_file":
            print("model_new.py builds its own extension with load_inline; nothing to compile here. "
                  "Run python3 -m utils.verification.")
            return 0
        spec = B.workspace_extension(sol, rec.device)
        opts = B.BuildOptions(device=rec.device, sandbox=SandboxConfig(enabled=not _no_sandbox()))
        res = B.build_extension(spec, opts, str(ws))
    except (WorkspaceError, SolutionError, TaskError, SandboxUnavailable, RuntimeError) as exc:
        print(f"Compilation failed: {exc}")
        return 1
    dt = time.perf_counter() - t0
    if not res.ok:
        print("Compilation failed.\n" + res.message)
        print(f"[TIME] Compilation took {dt:.2f}s")
        return 1
    target = ws / "cuda_extension.so"
    tmp = ws / f".cuda_extension.so.tmp{os.getpid()}"
    assert res.so_path is not None
    shutil.copyfile(res.so_path, tmp)
    os.replace(tmp, target)
    what = "cached build" if res.cached else (
        f"recompiled {', '.join(r for r in res.rebuilt if not r.startswith('link'))}" if res.rebuilt else "up to date")
    print(f"Compile success: cuda_extension.so ({what})")
    print(f"[TIME] Compilation took {dt:.2f}s")
    return 0


def verification_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m utils.verification")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    ws = _workspace()
    try:
        rec = load_record(ws)
        sol = load_solution(ws)
        res = evaluate(rec.task, sol, EvalOptions(device=rec.device, seed=args.seed, sandbox=not _no_sandbox(),
                                                  build_key=str(ws), profile=False))
    except (WorkspaceError, SolutionError, TaskError, SandboxUnavailable) as exc:
        print(f"[FAIL] {exc}")
        return 1
    if res.correct:
        for k in range(res.trials):
            print(f"[PASS] check {k + 1}/{res.trials}")
        print("[PASS] verify success")
        return 0
    print(f"[FAIL] {res.status}" + (f" ({res.rule})" if res.rule else ""))
    print(res.message)
    return 1


def profiling_main(argv: list[str] | None = None) -> int:
    """Verify, then time the solution against eager PyTorch and torch.compile."""
    ap = argparse.ArgumentParser(prog="python3 -m utils.profiling")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    ws = _workspace()
    try:
        rec = load_record(ws)
        sol = load_solution(ws)
        res = evaluate(rec.task, sol, EvalOptions(device=rec.device, seed=args.seed, sandbox=not _no_sandbox(),
                                                  build_key=str(ws), profile=True))
    except (WorkspaceError, SolutionError, TaskError, SandboxUnavailable) as exc:
        print(f"[FAIL] {exc}")
        return 1
    if not res.correct:
        print(f"[FAIL] {res.status}" + (f" ({res.rule})" if res.rule else ""))
        print(res.message)
        return 1
    unit = "device time" if res.device == "cuda" else "time"
    names = {"candidate": "Your kernels (model_new.py)", "eager": "Torch eager", "compile": "torch.compile"}
    for key, label in names.items():
        t = res.times_us.get(key)
        if t:
            print(f"{label:30s} {unit} median {t['median_us']:.2f} us "
                  f"(min {t['min_us']:.2f}, max {t['max_us']:.2f}, {int(t['iterations'])} runs)")
    if res.speedup_vs_eager is not None:
        print(f"Speedup vs torch eager:    {res.speedup_vs_eager:.3f}x")
        print(f"Speedup vs torch.compile:  {res.speedup_vs_compile:.3f}x")
        print(f"Reward ({res.reward_name}): {res.reward:g}")
    else:
        print(res.message)
    if res.flags:
        print("Flags: " + ", ".join(res.flags))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(compile_main())
