"""The evaluator's sandboxed processes: their environment, sandbox settings and command
lines, and the spares started ahead of them (see `warm`). The agent's shell and datagen's
checks run their processes with the same environment (`python_env`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from cuda_agent import sandbox
from cuda_agent.evaluator import warm
from cuda_agent.evaluator.options import EvalOptions
from cuda_agent.evaluator.protocol import BaselineLayout, RunLayout
from cuda_agent.paths import cache_dir, private_slot, runs_root


def python_env(device: str, threads: int | None = None) -> dict[str, str]:
    """The environment of a Python process the evaluator starts in the sandbox."""
    env = {"PYTHONHASHSEED": "0", "TORCH_SHOW_CPP_STACKTRACES": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    if device == "cpu":
        # Freed memory stays in the process for the next call (glibc: no mmap'd chunks, no
        # trimming), as CUDA's caching allocator keeps it on the GPU; otherwise whether a
        # large output is page-faulted in anew on each call depends on the process's
        # allocation history, and CPU times vary between processes with it. The price:
        # nothing freed goes back to the system before the process ends.
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    # The evaluator's own package must import inside the sandbox, also when it is found
    # through PYTHONPATH rather than installed.
    here = str(Path(__file__).resolve().parents[2])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *extra]))
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if key in os.environ:
            env[key] = os.environ[key]
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if device == "cuda":
        env["CUDA_MODULE_LOADING"] = "LAZY"
    # torch.compile in-process: no pool of compile workers inside the sandbox (it would
    # start one per core, and several sandboxes at once would race for them).
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


# What the fork server of the reference and candidate processes imports ahead of their
# jobs (see sandbox.forkserver): torch and the evaluator's modules that bind their clocks
# before any candidate code (the processes' own warm-up imports), nothing that touches CUDA.
PRELOAD = ("torch", "torch.profiler", "cuda_agent.tasks", "cuda_agent.evaluator.child",
           "cuda_agent.evaluator.guards", "cuda_agent.evaluator.tensors", "cuda_agent.evaluator.timing",
           "cuda_agent.evaluator.vouch", "cuda_agent.evaluator.op_watch", "cuda_agent.evaluator.distributions",
           "cuda_agent.evaluator.reference", "cuda_agent.evaluator.candidate")
# ... and of the baseline process: torch.compile's machinery too (5.7 s of imports here).
BASELINE_PRELOAD = ("torch", "torch.profiler", "torch._dynamo", "torch._inductor.compile_fx", "cuda_agent.tasks",
                    "cuda_agent.evaluator.child", "cuda_agent.evaluator.tensors", "cuda_agent.evaluator.timing",
                    "cuda_agent.evaluator.baseline_run")


def preload(modules: tuple[str, ...], device: str) -> tuple[str, ...]:
    """`modules` for a fork server where one is used for `device`: on the CPU; on CUDA only
    with CUDA_AGENT_FORKSERVER=1 (CUDA in a job forked from a server that never touched
    it is what torch's own fork rules allow, but it has not yet been run on a GPU here)."""
    if device == "cpu" or os.environ.get("CUDA_AGENT_FORKSERVER") == "1":
        return modules
    return ()


def sandbox_config(opts: EvalOptions, timeout: float, device: str) -> sandbox.SandboxConfig:
    return sandbox.SandboxConfig(
        enabled=opts.sandbox, timeout_s=timeout, max_processes=opts.max_processes,
        gpu_index=opts.gpu_index if device == "cuda" else None, memory_mb=opts.memory_limit_mb(),
    )


def new_run_dir(prefix: str = "eval-") -> Path:
    """A fresh run directory under the cache, readable by the sandbox's uid."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=runs_root()))
    os.chmod(work, 0o755)
    return work


def command(kind: str, run: RunLayout, opts: EvalOptions, device: str, threads: int,
            wait: bool = False) -> tuple[list[str], dict[str, Any]]:
    """argv and sandbox arguments of the reference or candidate process of `run`.

    The reference writes the inputs to `shared/` (which the candidate reads) and the
    expected outputs to `private/` (which the candidate never sees). The candidate reads
    its spec, the built extension(s) and the task's code from `cin/`, and writes only to
    `run/`. With `wait`, the process starts ahead of its job (see `warm`)."""
    tail = ["--wait", device, str(warm.IDLE_S)] if wait else []
    config = sandbox_config(opts, opts.run_timeout_s, device)
    if kind == "reference":
        return ([sys.executable, "-m", "cuda_agent.evaluator.reference", str(run.reference_spec), *tail],
                dict(cwd=run.private, writable=[run.shared, run.private],
                     env=python_env(device), config=config, preload=preload(PRELOAD, device)))
    return ([sys.executable, "-m", "cuda_agent.evaluator.candidate", str(run.candidate_spec), *tail],
            dict(cwd=run.run, writable=[run.run], readonly=[run.shared, run.cin, run.gate],
                 env=python_env(device, threads), config=config, preload=preload(PRELOAD, device)))


def start(kind: str, run: RunLayout, opts: EvalOptions, device: str, threads: int,
          timeout_s: float) -> warm.Proc:
    argv, kw = command(kind, run, opts, device, threads)
    return warm.Proc(argv, **kw, timeout_s=timeout_s)


def baseline_proc(layout: BaselineLayout, opts: EvalOptions, device: str, threads: int, timeout_s: float,
                  wait: bool = False) -> warm.Proc:
    """The baseline process of `layout`, started now. torch.compile's own caches persist
    between evaluations (trusted code only writes there), one cache per concurrent
    baseline process: the process holds its slot until it ends."""
    stack = contextlib.ExitStack()
    compile_cache = stack.enter_context(private_slot(cache_dir("compile")))
    try:
        env = python_env(device, threads)
        # TMPDIR too: inductor keeps its precompiled headers under the temporary directory,
        # not its cache directory, and the sandbox's own /tmp is new every run (seconds of
        # header compilation on every cache hit, on the CPU).
        (compile_cache / "tmp").mkdir(exist_ok=True)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(compile_cache / "inductor"),
                   TRITON_CACHE_DIR=str(compile_cache / "triton"), TMPDIR=str(compile_cache / "tmp"))
        tail = ["--wait", device, str(warm.IDLE_S)] if wait else []
        return warm.Proc(
            [sys.executable, "-m", "cuda_agent.evaluator.baseline_run", str(layout.spec), *tail],
            cwd=layout.out, writable=[layout.out, compile_cache], readonly=[layout.task_code.parent, layout.gate],
            env=env, config=sandbox_config(opts, opts.run_timeout_s, device), timeout_s=timeout_s,
            on_exit=stack.close, preload=preload(BASELINE_PRELOAD, device))
    except BaseException:
        stack.close()
        raise


# -- spares ----------------------------------------------------------------------------------


def device_key(opts: EvalOptions, device: str) -> tuple[str, int]:
    """What a spare's device stage must not overlap a measurement of (see `warm.Pool.measuring`)."""
    return (device, opts.gpu_index)


def spare_key(opts: EvalOptions, device: str, threads: int) -> tuple[Any, ...]:
    return (*device_key(opts, device), threads, opts.sandbox, opts.max_processes, opts.memory_limit_mb(),
            os.environ.get("PYTHONPATH", ""))


def baseline_spare_key(opts: EvalOptions, device: str, threads: int) -> tuple[Any, ...]:
    return ("baseline", *spare_key(opts, device, threads))


def start_spare(opts: EvalOptions, device: str, threads: int) -> warm.Spare:
    """A reference and a candidate process waiting in a fresh run directory."""
    run = RunLayout(new_run_dir()).make()
    spare = warm.Spare(work=run.work, device=device_key(opts, device))
    try:
        for kind in ("reference", "candidate"):
            argv, kw = command(kind, run, opts, device, threads, wait=True)
            spare.procs[kind] = warm.Proc(argv, **kw, timeout_s=warm.IDLE_S + 60)
    except BaseException:
        spare.close()
        raise
    return spare


def start_baseline_spare(opts: EvalOptions, device: str, threads: int) -> warm.Spare:
    """A baseline process waiting in a fresh baseline directory."""
    layout = BaselineLayout(new_run_dir("baseline-")).make()
    spare = warm.Spare(work=layout.base, ready_dirs=("out",), device=device_key(opts, device))
    try:
        spare.procs["baseline"] = baseline_proc(layout, opts, device, threads, warm.IDLE_S + 60, wait=True)
    except BaseException:
        spare.close()
        raise
    return spare
