"""The trusted evaluator: task + solution + device -> one `EvalResult`.

    static checks -> build (sandboxed, cached) -> candidate process: trials | profile -> judge
                  \\-> reference process (sandboxed, beside the build) --/         |
                                   baseline process (on a cache miss): compile | measure
                                   (overlaps verification; measures while nothing else does)

Profiling follows verification in the same candidate process: candidate and eager are
timed interleaved there, torch.compile and eager in the trusted baseline process, whose
results are cached (see `speed` for how the two are combined).

Every candidate-touching step runs in its own sandboxed process; whatever the candidate
does (crash, hang, fork bomb, hostile file writes) ends as a verdict here, never as an
exception that escapes `evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent import sandbox
from cuda_agent.evaluator import baselines as BL
from cuda_agent.evaluator import build as B
from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules, speed, timing, warm
from cuda_agent.evaluator.reward import Speeds, reward
from cuda_agent.evaluator.solution import SINGLE_FILE, WORKSPACE, Solution
from cuda_agent.evaluator.static_checks import check_solution
from cuda_agent.files import atomic_write
from cuda_agent.machine import usable_cores as _usable_cores
from cuda_agent.paths import cache_dir, private_slot, short_hash
from cuda_agent.tasks import Task, TaskError


@dataclass
class EvalOptions:
    device: str = "auto"  # "cuda" | "cpu" | "auto"
    atol: float = 1e-2
    rtol: float = 1e-2
    trials: int = 5
    seed: int | None = None  # None: fresh random seeds per evaluation (recorded in the result)
    sandbox: bool = True
    gpu_index: int = 0
    arch: str | None = None
    build_timeout_s: float = 600.0
    run_timeout_s: float = 300.0
    max_processes: int = 512
    build_key: str | None = None  # which kept build directory to use; default: the solution's origin
    keep_run_dir: bool = False
    jobs: int | None = None
    static_checks: bool = True  # off only to test that the runtime checks stand on their own
    profile: bool = True  # time a correct solution against eager and torch.compile
    reward_name: str = "milestone"
    threshold: float = 0.05
    compile_mode: str = "default"
    threads: int | None = None  # torch/OpenMP threads in the timed processes; default: all usable cores
    protocol: timing.Protocol = field(default_factory=timing.Protocol)
    # The device probe beside the candidate this far off the probe beside the cached
    # baselines re-measures them (see baselines.drifted); None: 0.05 on CUDA, 0.25 on the
    # CPU (whose timings between processes are noisier).
    drift_bound: float | None = None
    baseline_cache: bool = True
    # Take a spare (reference and candidate processes started ahead, see `warm`) when one
    # is ready, and leave one for the next evaluation: for long-lived evaluators.
    warm: bool = False
    # With `warm`, also a spare baseline process for the next task whose baselines are
    # measured; None: on CUDA (where its warm-up, CUDA and the profiler, saves seconds).
    warm_baseline: bool | None = None
    # With `warm`, start the next evaluation's spare when this one takes its own, not after
    # it: its host stage (imports) overlaps this evaluation, its device stage waits for the
    # end of this one's measurements (see `warm`). None: on CUDA (on the CPU the host stage
    # would share the cores being timed, so there the spare waits whole).
    early_spare: bool | None = None

BASELINE_SEEDS = [7001, 7002, 7003, 7004, 7005]  # baselines do not depend on an evaluation's seeds


@dataclass
class BuildOutcome:
    ok: bool
    extensions: list[dict[str, str]] = field(default_factory=list)
    message: str = ""
    status: str = R.COMPILE_ERROR
    rule: str | None = None
    cached: bool = True
    rebuilt: list[str] = field(default_factory=list)


def resolve_device(device: str) -> str:
    if device in ("cuda", "cpu"):
        return device
    if device != "auto":
        raise ValueError(f"unknown device {device!r}; use cuda, cpu or auto")
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sandbox_config(opts: EvalOptions, timeout: float, device: str) -> sandbox.SandboxConfig:
    return sandbox.SandboxConfig(
        enabled=opts.sandbox, timeout_s=timeout, max_processes=opts.max_processes,
        gpu_index=opts.gpu_index if device == "cuda" else None,
    )


def _python_env(device: str, threads: int | None = None) -> dict[str, str]:
    env = {"PYTHONHASHSEED": "0", "TORCH_SHOW_CPP_STACKTRACES": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    if device == "cpu":
        # Freed memory stays in the process for the next call (glibc: no mmap'd chunks, no
        # trimming), as CUDA's caching allocator keeps it on the GPU. By default a large
        # CPU tensor is mmap'd and page-faulted anew, or not, depending on the process's
        # allocation history and address layout. A 16 MB elementwise chain evaluated in 5
        # separate processes on a 2-core machine (benchmarks/profile_repeatability.py):
        # candidate 2.75-5.87 ms (CoV 35%), eager 13.0-25.0 ms (32%); with this, 3.23-3.31
        # ms (1.0%) and 10.2-12.8 ms (10%). The price: nothing freed goes back to the system
        # before the process ends, and a large block is carved from the heap, not mapped.
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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _layout(work: Path) -> None:
    """The run directory's parts that the sandboxed processes bind (see `_command`)."""
    for d in ("shared", "private", "run/out", "cin/ext", "gate-candidate"):
        (work / d).mkdir(parents=True, exist_ok=True)
        os.chmod(work / d, 0o755)


def _command(kind: str, work: Path, opts: EvalOptions, device: str, threads: int,
             wait: bool = False) -> tuple[list[str], dict[str, Any]]:
    """argv and sandbox arguments of the reference or candidate process of `work`.

    The reference writes the inputs to `shared/` (which the candidate reads) and the
    expected outputs to `private/` (which the candidate never sees). The candidate reads
    its spec, the built extension(s) and the task's `Model` from `cin/`, and writes only
    to `run/`. With `wait`, the process starts ahead of its job (see `warm`)."""
    tail = ["--wait", device, str(warm.IDLE_S)] if wait else []
    config = _sandbox_config(opts, opts.run_timeout_s, device)
    if kind == "reference":
        spec = work / "private" / "reference_spec.json"
        return ([sys.executable, "-m", "cuda_agent.evaluator.reference", str(spec), *tail],
                dict(cwd=work / "private", writable=[work / "shared", work / "private"],
                     env=_python_env(device), config=config))
    spec = work / "cin" / "candidate_spec.json"
    return ([sys.executable, "-m", "cuda_agent.evaluator.candidate", str(spec), *tail],
            dict(cwd=work / "run", writable=[work / "run"],
                 readonly=[work / "shared", work / "cin", work / "gate-candidate"],
                 env=_python_env(device, threads), config=config))


def _device_key(opts: EvalOptions, device: str) -> tuple[str, int]:
    """What a spare's device stage must not overlap a measurement of (see `warm.Pool.measuring`)."""
    return (device, opts.gpu_index)


def _spare_key(opts: EvalOptions, device: str, threads: int) -> tuple[Any, ...]:
    return (*_device_key(opts, device), threads, opts.sandbox, opts.max_processes, os.environ.get("PYTHONPATH", ""))


def _start_spare(opts: EvalOptions, device: str, threads: int) -> warm.Spare:
    work = Path(tempfile.mkdtemp(prefix="eval-", dir=cache_dir("runs")))
    os.chmod(work, 0o755)
    _layout(work)
    spare = warm.Spare(work=work, device=_device_key(opts, device))
    try:
        for kind in ("reference", "candidate"):
            argv, kw = _command(kind, work, opts, device, threads, wait=True)
            spare.procs[kind] = warm.Proc(argv, **kw, timeout_s=warm.IDLE_S + 60)
    except BaseException:
        spare.close()
        raise
    return spare


def _baseline_layout(base: Path) -> None:
    """A baseline run's directory: out/ (its cwd, the only place it writes), gate/ (where
    the evaluator says go), task/ (its copy of the task)."""
    for d in ("out", "gate", "task"):
        (base / d).mkdir(parents=True, exist_ok=True)
        os.chmod(base / d, 0o755)


def _baseline_proc(base: Path, opts: EvalOptions, device: str, threads: int, timeout_s: float,
                   wait: bool = False) -> warm.Proc:
    """The baseline process of `base`, started now. torch.compile's own caches persist
    between evaluations (trusted code only writes there), one cache per concurrent
    baseline process: the process holds its slot until it ends."""
    stack = contextlib.ExitStack()
    compile_cache = stack.enter_context(private_slot(cache_dir("compile")))
    try:
        env = _python_env(device, threads)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(compile_cache / "inductor"),
                   TRITON_CACHE_DIR=str(compile_cache / "triton"))
        tail = ["--wait", device, str(warm.IDLE_S)] if wait else []
        return warm.Proc(
            [sys.executable, "-m", "cuda_agent.evaluator.baseline_run", str(base / "out" / "spec.json"), *tail],
            cwd=base / "out", writable=[base / "out", compile_cache], readonly=[base / "task", base / "gate"],
            env=env, config=_sandbox_config(opts, opts.run_timeout_s, device), timeout_s=timeout_s,
            on_exit=stack.close)
    except BaseException:
        stack.close()
        raise


def _baseline_spare_key(opts: EvalOptions, device: str, threads: int) -> tuple[Any, ...]:
    return ("baseline", *_spare_key(opts, device, threads))


def _start_baseline_spare(opts: EvalOptions, device: str, threads: int) -> warm.Spare:
    base = Path(tempfile.mkdtemp(prefix="baseline-", dir=cache_dir("runs")))
    os.chmod(base, 0o755)
    _baseline_layout(base)
    spare = warm.Spare(work=base, ready_dirs=("out",), device=_device_key(opts, device))
    try:
        spare.procs["baseline"] = _baseline_proc(base, opts, device, threads, warm.IDLE_S + 60, wait=True)
    except BaseException:
        spare.close()
        raise
    return spare


class Evaluation:
    """One evaluation; `run()` returns the record. Split into steps for readability."""

    def __init__(self, task: Task, solution: Solution, opts: EvalOptions) -> None:
        self.task = task
        self.solution = solution
        self.opts = opts
        self.device = resolve_device(opts.device)
        self.drift_bound = opts.drift_bound if opts.drift_bound is not None else (
            0.05 if self.device == "cuda" else 0.25)
        if opts.seed is None:
            rng = random.SystemRandom()
            self.init_seed = rng.randrange(2**31)
            self.seeds = [rng.randrange(2**31) for _ in range(opts.trials)]
        else:
            self.init_seed = opts.seed
            self.seeds = [opts.seed + 1 + k for k in range(opts.trials)]
        self.timings: dict[str, float] = {}
        self.t_start = time.perf_counter()
        self.marks: dict[str, float] = {}  # when each step of `_run` ended (s since its start)
        self.threads = opts.threads or _usable_cores()
        self.work = Path(tempfile.mkdtemp(prefix="eval-", dir=cache_dir("runs")))
        os.chmod(self.work, 0o755)
        _layout(self.work)
        self.spare: warm.Spare | None = None
        self.baseline: BL.Baseline | None = None
        self.baseline_fresh = False
        self.baseline_error: str | None = None
        self.flags: list[str] = []
        self.gated = False  # the candidate's profile waits for a baseline measurement
        self.details_extra: dict[str, Any] = {}
        self.warm_baseline = opts.warm and (opts.warm_baseline if opts.warm_baseline is not None
                                            else self.device == "cuda")
        self.baseline_dirs: list[Path] = []  # spares' directories this evaluation used
        self.baseline_proc: warm.Proc | None = None

    def result(self, status: str, message: str, **kw: Any) -> R.EvalResult:
        return R.EvalResult(
            status=status, message=message, task_id=self.task.id, task_name=self.task.name,
            device=self.device, seeds=[self.init_seed, *self.seeds], trials=self.opts.trials,
            timings_s={k: round(v, 3) for k, v in self.timings.items()},
            solution_hash=self.solution.content_hash, solution_format=self.solution.format,
            sandboxed=self.opts.sandbox, reward_name=self.opts.reward_name,
            **{"flags": list(dict.fromkeys(self.flags)), **kw},
        )

    def mark(self, step: str) -> None:
        self.marks[step] = round(time.perf_counter() - self.t_start, 4)

    # -- steps ---------------------------------------------------------------------------

    def take_spare(self) -> None:
        """Run in a spare's directory, with its processes, when one is ready."""
        if not self.opts.warm:
            return
        spare = warm.POOL.take(_spare_key(self.opts, self.device, self.threads))
        if spare is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work, self.spare = spare.work, spare
        early = self.opts.early_spare if self.opts.early_spare is not None else self.device == "cuda"
        if early:
            # held before its device stage until this evaluation's measurements end (`run`)
            threading.Thread(target=self.offer_spare, daemon=True).start()

    def offer_spare(self) -> None:
        with contextlib.suppress(Exception):
            warm.POOL.offer(_spare_key(self.opts, self.device, self.threads),
                            lambda: _start_spare(self.opts, self.device, self.threads))

    def start_process(self, kind: str, timeout: float) -> tuple[warm.Proc, bool]:
        """The spare's process of this kind (given its job's timeout), or a new one; its
        spec must be in place. True when it is the spare's."""
        if self.spare is not None and kind in self.spare.procs:
            proc = self.spare.procs.pop(kind)
            proc.deadline.set_in(timeout)
            proc.started = time.perf_counter()
            return proc, True
        argv, kw = _command(kind, self.work, self.opts, self.device, self.threads)
        return warm.Proc(argv, **kw, timeout_s=timeout), False

    def start_reference(self) -> threading.Thread:
        shared = self.work / "shared"
        private = self.work / "private"
        task_path = private / "model.py"
        task_path.write_text(self.task.code)
        spec = {"task_path": str(task_path), "task_name": self.task.name, "shared_dir": str(shared),
                "private_dir": str(private), "device": self.device, "seeds": self.seeds,
                "init_seed": self.init_seed}
        atomic_write(private / "reference_spec.json", json.dumps(spec))
        self.reference_run: sandbox.RunResult | None = None
        proc, spare = self.start_process("reference", self.opts.run_timeout_s)

        def go() -> None:
            t0 = time.perf_counter()
            run = proc.wait()
            if spare and not (private / "started").exists() and not run.timed_out:
                # the spare died before its job (not the task's doing): once more, cold
                run = self.start_process("reference", self.opts.run_timeout_s)[0].wait()
            self.reference_run = run
            self.timings["reference"] = time.perf_counter() - t0
            if not (shared / "ready").exists():
                (shared / "failed").write_text("failed")  # release a candidate waiting for inputs

        th = threading.Thread(target=go, daemon=True)
        th.start()
        return th

    def reference_outcome(self) -> dict[str, Any]:
        status = _read_json(self.work / "private" / "reference.json")
        run = self.reference_run
        if status is None or not status.get("ok"):
            if status is not None:
                why = f"{status.get('error')} in {status.get('phase')}"
            elif run is not None and run.timed_out:
                why = f"timed out after {self.opts.run_timeout_s:g} s"
            else:
                why = (run.describe() if run else "did not run") + (
                    f": {run.stderr.strip()[-800:]}" if run and run.stderr.strip() else "")
            raise TaskError(f"task {self.task.name} failed to run its reference Model: {why}")
        return status

    def build(self) -> BuildOutcome:
        opts = self.opts
        bopts = B.BuildOptions(
            device=self.device, timeout_s=opts.build_timeout_s, arch=opts.arch, gpu_index=opts.gpu_index,
            jobs=opts.jobs, sandbox=_sandbox_config(opts, opts.build_timeout_s, self.device),
        )
        key = opts.build_key or self.solution.origin
        if self.solution.format == SINGLE_FILE:
            specs_or_error = self.capture_inline()
            if isinstance(specs_or_error, BuildOutcome):
                return specs_or_error
            specs = specs_or_error
        else:
            specs = [B.workspace_extension(self.solution, self.device)]
        outcome = BuildOutcome(ok=True)
        for spec in specs:
            res = B.build_extension(spec, bopts, key)
            outcome.cached &= res.cached
            outcome.rebuilt += res.rebuilt
            if not res.ok:
                status = R.TIMEOUT if res.timed_out else R.COMPILE_ERROR
                return BuildOutcome(ok=False, message=res.message, status=status, cached=False)
            outcome.extensions.append({"name": spec.name, "so_path": str(res.so_path)})
        return outcome

    def capture_inline(self) -> list[B.ExtensionSpec] | BuildOutcome:
        d = self.work / "capture"
        d.mkdir()
        (d / "model_new.py").write_text(self.solution.model_new)
        out = d / "calls.json"
        run = sandbox.run(
            [sys.executable, "-m", "cuda_agent.evaluator.inline_capture", str(d), str(out)],
            cwd=d, writable=[d], env=_python_env(self.device),
            config=_sandbox_config(self.opts, self.opts.run_timeout_s, "cpu"),
        )
        data = _read_json(out)
        if run.timed_out:
            return BuildOutcome(ok=False, status=R.TIMEOUT,
                                message=f"importing model_new.py timed out after {self.opts.run_timeout_s:g} s")
        if data is None:
            return BuildOutcome(ok=False, status=R.RUNTIME_ERROR,
                                message=f"importing model_new.py to find its load_inline call {run.describe()}")
        calls = data.get("calls") or []
        if not data.get("ok") and not calls:
            return BuildOutcome(ok=False, status=R.RUNTIME_ERROR,
                                message=f"model_new.py failed before calling load_inline: {data.get('error')}")
        if not calls:
            return BuildOutcome(ok=False, status=R.REJECTED, rule=rules.NO_EXTENSION,
                                message="model_new.py never calls load_inline, so it builds no extension.")
        return [B.inline_extension(c, self.device) for c in calls if isinstance(c, dict)]

    def run_candidate(self, extensions: list[dict[str, str]]) -> tuple[sandbox.RunResult, Path]:
        run_dir = self.work / "run"
        for rel, text in self.solution.files.items():
            p = run_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        # The built extensions go where the candidate's sandbox can read them (`cin/`).
        placed = []
        for k, ext in enumerate(extensions):
            src = Path(ext["so_path"])
            dst = self.work / "cin" / "ext" / str(k) / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(dst.parent, 0o755)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            placed.append({**ext, "so_path": str(dst)})
        spec: dict[str, Any] = {
            "run_dir": str(run_dir), "inputs_dir": str(self.work / "shared"), "device": self.device,
            "trials": self.opts.trials, "init_seed": self.init_seed, "format": self.solution.format,
            "extensions": placed, "threads": self.threads}
        if self.opts.profile:
            spec["profile"] = {"task_path": str(self.task_copy), "gate_dir": str(self.gate("candidate")),
                               "protocol": dataclasses.asdict(self.opts.protocol),
                               "gate_timeout_s": self.opts.run_timeout_s}
        atomic_write(self.work / "cin" / "candidate_spec.json", json.dumps(spec))
        timeout = self.opts.run_timeout_s * (2 if self.gated else 1)
        t0 = time.perf_counter()
        proc, spare = self.start_process("candidate", timeout)
        run = proc.wait()
        if spare and not (run_dir / "out" / "progress.json").exists() and not run.timed_out:
            # the spare died before its job (not the candidate's doing): once more, cold
            self.details_extra["spare_failed"] = run.describe()
            run = self.start_process("candidate", timeout)[0].wait()
        elif spare:
            self.details_extra["warm_start"] = True
        self.timings["candidate"] = time.perf_counter() - t0
        return run, run_dir

    # -- baselines -------------------------------------------------------------------------

    def gate(self, who: str) -> Path:
        d = self.work / f"gate-{who}"
        if not d.exists():
            d.mkdir()
            os.chmod(d, 0o755)
        return d

    @property
    def task_copy(self) -> Path:
        p = self.work / "cin" / "task_model.py"
        if not p.exists():
            p.write_text(self.task.code)
            os.chmod(p, 0o644)
        return p

    def baseline_key(self) -> BL.BaselineKey:
        proto = self.opts.protocol
        return BL.BaselineKey(
            task_id=self.task.id, device_name=BL.device_name(self.device, self.opts.gpu_index),
            torch_version=BL.torch_version(),
            protocol_version=timing.PROTOCOL_VERSION * 1000 + hash_protocol(proto),
            compile_mode=self.opts.compile_mode, threads=self.threads)

    def start_baseline(self, gated: bool) -> threading.Thread:
        """The trusted baseline process (a spare's when one is ready); with `gated` it
        waits for the go before it measures."""
        spare = warm.POOL.take(_baseline_spare_key(self.opts, self.device, self.threads)) \
            if self.warm_baseline else None
        if spare is not None:
            base = spare.work
            self.baseline_dirs.append(base)
        else:
            base = self.work / f"baseline-{sum(1 for _ in self.work.glob('baseline-*'))}"
            _baseline_layout(base)
        out, gate = base / "out", base / "gate"
        task_path = base / "task" / "task_model.py"
        task_path.write_text(self.task.code)
        os.chmod(task_path, 0o644)
        if not gated:
            (gate / "go").write_text("go")
        spec = {"task_path": str(task_path), "task_name": self.task.name, "device": self.device,
                "init_seed": 0, "seeds": BASELINE_SEEDS, "compile_mode": self.opts.compile_mode,
                "threads": self.threads, "protocol": dataclasses.asdict(self.opts.protocol),
                "gate_dir": str(gate), "out_dir": str(out), "gate_timeout_s": self.opts.run_timeout_s}
        self.baseline_out, self.baseline_gate = out, gate
        timeout = self.opts.run_timeout_s
        if spare is not None:
            proc = spare.procs.pop("baseline")
            proc.deadline.set_in(timeout)
        atomic_write(out / "spec.json", json.dumps(spec))
        if spare is None:
            proc = _baseline_proc(base, self.opts, self.device, self.threads, timeout)
        self.baseline_proc = proc

        def go() -> None:
            t0 = time.perf_counter()
            run = proc.wait()
            if spare is not None and not (out / "baseline.json").exists() and not run.timed_out:
                # the spare died before its job (not the task's doing): once more, cold
                self.details_extra["baseline_spare_failed"] = run.describe()
                again = _baseline_proc(base, self.opts, self.device, self.threads, timeout)
                self.baseline_proc = again
                run = again.wait()
            elif spare is not None:
                self.details_extra["baseline_warm_start"] = True
            self.timings["baseline"] = self.timings.get("baseline", 0.0) + time.perf_counter() - t0
            self.baseline_run = run
            if not (out / "compiled").exists():
                (out / "compiled").write_text("failed")

        th = threading.Thread(target=go, daemon=True)
        th.start()
        return th

    def finish_baseline(self, th: threading.Thread) -> None:
        th.join()
        data = _read_json(self.baseline_out / "baseline.json")
        if data and data.get("ok") and data.get("compile_error"):
            # torch.compile failed: once more in a fresh process (the device is still the
            # baseline's), since a failure can be the process's, not the task's.
            first = data["compile_error"]
            self.start_baseline(gated=False).join()
            again = _read_json(self.baseline_out / "baseline.json")
            if again and again.get("ok"):
                data = again
                data["compile_retried"] = first
        if not data or not data.get("ok"):
            run = getattr(self, "baseline_run", None)
            why = (f"{data.get('error')} in {data.get('phase')}" if data else
                   (run.describe() if run else "did not run"))
            self.baseline_error = f"the baseline measurement failed: {why}"
            return
        extra = {k: data.get(k) for k in ("compile_s", "compile_error", "compile_retried", "compile_traceback", "compile_matches_eager", "copy_gbps",
                                           "device_name", "threads", "torch_version", "seconds", "measure_s", "probe") if k in data}
        key = self.baseline_key()
        # A baseline whose torch.compile failed stands in eager for compile; it is used
        # for this evaluation but never cached, so a passing failure cannot inflate the
        # rewards of every later evaluation of the task.
        if self.opts.baseline_cache and not data.get("compile_error"):
            self.baseline = BL.store(key, data["eager"], data["compile"], extra=extra)
        else:
            self.baseline = BL.Baseline(eager=data["eager"], compile=data["compile"], measured_at=time.time(),
                                        extra=extra)
        self.baseline_fresh = True

    def plan_baseline(self) -> threading.Thread | None:
        """Use the cached baselines, or start measuring them (gated) beside verification."""
        if not self.opts.profile:
            return None
        cached = BL.load(self.baseline_key()) if self.opts.baseline_cache else None
        if cached is not None:
            self.baseline = cached
            (self.gate("candidate") / "go").write_text("go")
            return None
        self.gated = True
        return self.start_baseline(gated=True)

    def schedule_device(self, base: threading.Thread, cand: threading.Thread, ref: threading.Thread) -> None:
        """One measurement at a time: the baselines once they are compiled and nothing else
        runs on the device (verification done, reference done), then the candidate's profile."""
        progress = self.work / "run" / "out" / "progress.json"
        compiled = self.baseline_out / "compiled"
        while True:
            phase = (_read_json(progress) or {}).get("phase")
            cand_idle = not cand.is_alive() or phase in ("waiting for the device", "done")
            if (compiled.exists() or not base.is_alive()) and cand_idle and not ref.is_alive():
                break
            time.sleep(0.01)
        (self.baseline_gate / "go").write_text("go")
        self.finish_baseline(base)
        (self.gate("candidate") / "go").write_text("go")

    def io_bytes(self) -> int:
        """Bytes of one call's inputs and outputs (trial 1), the least traffic a call can have."""
        import torch

        from cuda_agent.evaluator.tensors import tensors

        try:
            ins = torch.load(self.work / "shared" / "inputs_0.pt", weights_only=True)
            outs = torch.load(self.work / "private" / "expected_0.pt", weights_only=True)
        except Exception:
            return 0
        return sum(t.numel() * t.element_size() for _, t in [*tensors(ins), *tensors(outs)])

    def profile_verdict(self, res: R.EvalResult, run_dir: Path) -> R.EvalResult:
        import torch

        from cuda_agent.evaluator.compare import compare_outputs

        report = _read_json(run_dir / "out" / "report.json") or {}
        prof = report.get("profile")
        if prof is None or self.baseline is None:
            why = self.baseline_error or "the candidate process was not given the device"
            self.flags.append(R.FLAG_NOT_PROFILED)
            return self.result(R.OK, f"{res.message} Not profiled: {why}.", correct=True, trials_passed=res.trials_passed,
                               reward=reward(self.opts.reward_name, True, None, self.opts.threshold))
        self.timings["profile"] = float(prof.get("seconds", 0.0))
        # Timed calls must have computed the right answer, not replayed an earlier one.
        missing = sorted(set(range(self.opts.trials)) - set(prof.get("timed_outputs", [])))
        if missing:
            return self.result(R.INCORRECT, f"the check calls made while timing returned no output for trial "
                               f"{missing[0] + 1}'s inputs.", rule=rules.TIMED_OUTPUT, trials_passed=res.trials_passed)
        for k in prof.get("timed_outputs", []):
            try:
                expected = torch.load(self.work / "private" / f"expected_{k}.pt", weights_only=True)
                got = torch.load(run_dir / "out" / f"timed_{k}.pt", weights_only=True)
            except Exception as exc:
                return self.result(R.RUNTIME_ERROR, f"the outputs of the timed calls could not be read "
                                   f"({type(exc).__name__}: {exc}).", trials_passed=res.trials_passed)
            m = compare_outputs(expected, got, self.opts.atol, self.opts.rtol)
            if m:
                return self.result(R.INCORRECT, f"a timed call on trial {k + 1}'s inputs returned a wrong result "
                                   f"({m.message}); every call must compute its output from its inputs (no "
                                   "caching of earlier results).", rule=rules.TIMED_OUTPUT,
                                   trials_passed=res.trials_passed)
        eager_now, probe_now = prof["eager"], prof.get(timing.PROBE)
        probe_now_us = probe_now["device"]["median_us"] if isinstance(probe_now, dict) else None
        if not self.baseline_fresh and BL.drifted(self.baseline, eager_now["device"]["median_us"], probe_now_us,
                                                  self.drift_bound):
            # The device is not what it was when the baselines were cached: measure them again.
            self.flags.append(R.FLAG_REMEASURED)
            th = self.start_baseline(gated=False)
            self.finish_baseline(th)
            if self.baseline_error:
                self.flags.append(R.FLAG_NOT_PROFILED)
                return self.result(R.OK, f"{res.message} Not profiled: {self.baseline_error}.", correct=True,
                                   trials_passed=res.trials_passed,
                                   reward=reward(self.opts.reward_name, True, None, self.opts.threshold))
        base = self.baseline
        assert base is not None
        compile_note = ""
        if base.extra.get("compile_error"):
            self.flags.append(R.FLAG_COMPILE_FAILED)
            compile_note = (f" torch.compile failed on this task ({str(base.extra['compile_error'])[:200]}), "
                            "so its baseline is eager.")
        elif base.extra.get("compile_matches_eager") is False:
            self.flags.append(R.FLAG_COMPILE_DIFFERS)
        sp = speed.judge(prof["candidate"], eager_now, base.eager, base.compile, self.device,
                         self.opts.protocol.target_rel_ci, self.drift_bound,
                         io_bytes=self.io_bytes(), bandwidth_gbps=float(base.extra.get("copy_gbps") or 0.0),
                         probe_now=probe_now, probe_base=base.extra.get("probe"))
        self.flags += sp.flags
        fields: dict[str, Any] = dict(
            times_us=sp.times_us, wall_times_us=sp.wall_times_us, speedup_vs_eager=sp.speedup_vs_eager,
            speedup_vs_compile=sp.speedup_vs_compile, wall_speedup_vs_eager=sp.wall_speedup_vs_eager,
            wall_speedup_vs_compile=sp.wall_speedup_vs_compile, trials_passed=res.trials_passed,
            details={**res.details, **sp.details, "threads": self.threads, "compile_mode": self.opts.compile_mode,
                     "baseline": "measured" if self.baseline_fresh else "cached",
                     "baseline_measured_at": base.measured_at,
                     "kernels": {n: prof[n].get("kernels", {}) for n in ("candidate", "eager")},
                     "compile_kernels": base.compile.get("kernels", {}),
                     "candidate_measure_s": prof.get("measure_s"),
                     **({"baseline_measure_s": base.extra.get("measure_s")} if self.baseline_fresh else {}),
                     **{k: base.extra[k] for k in ("compile_error", "compile_retried", "compile_traceback")
                        if base.extra.get(k)}})
        if sp.rejected:
            return self.result(R.REJECTED, sp.rejected[1], rule=sp.rejected[0], **fields)
        c = sp.times_us["candidate"]["median_us"]
        speeds = Speeds(candidate_s=c, eager_s=c * sp.speedup_vs_eager, compile_s=c * sp.speedup_vs_compile)
        value = reward(self.opts.reward_name, True, speeds, self.opts.threshold)
        what = "device time" if self.device == "cuda" else "time"
        return self.result(R.OK, f"{res.message} {what}: {sp.speedup_vs_eager:.3f}x eager, "
                           f"{sp.speedup_vs_compile:.3f}x torch.compile.{compile_note}", correct=True, reward=value, **fields)

    def judge(self, run: sandbox.RunResult, run_dir: Path, reference: dict[str, Any]) -> R.EvalResult:
        import torch

        from cuda_agent.evaluator.compare import compare_devices, compare_outputs

        out = run_dir / "out"
        report = _read_json(out / "report.json")
        progress = _read_json(out / "progress.json") or {}
        where = progress.get("phase", "start-up")
        if progress.get("trial"):
            where = f"trial {progress['trial']}"
        if run.timed_out:
            return self.result(R.TIMEOUT, f"the candidate did not finish within {self.opts.run_timeout_s:g} s "
                               f"(during {where}); look for an infinite loop or a hung kernel.")
        if report is None:
            tail = run.stderr.strip()[-1500:]
            return self.result(R.RUNTIME_ERROR, f"the candidate process {run.describe()} during {where}"
                               + (f"; stderr ends with:\n{tail}" if tail else "."),
                               details={"signal": run.signal, "returncode": run.returncode})
        error = report.get("error")
        trials = report.get("trials") or []
        passed = 0
        if error == "runtime":
            return self.result(R.RUNTIME_ERROR, report.get("message", "runtime error"),
                               details={"traceback": report.get("traceback", "")})
        if error in ("rejected", "incorrect"):
            status = R.REJECTED if error == "rejected" else R.INCORRECT
            return self.result(status, report.get("message", ""), rule=report.get("rule"))
        structures = reference.get("structures") or []
        for k, trial in enumerate(trials):
            label = f"trial {trial.get('trial', k + 1)} of {self.opts.trials}"
            guard = trial.get("guard")
            if guard:
                return self.result(R.REJECTED, f"{label}: {guard[1]}", rule=guard[0], trials_passed=passed)
            if "exception" in trial:
                return self.result(R.RUNTIME_ERROR, f"{label}: ModelNew.forward raised {trial['exception']}",
                                   details={"traceback": trial.get("traceback", "")}, trials_passed=passed)
            if trial.get("extension_calls", 0) == 0:
                return self.result(R.REJECTED, f"{label}: ModelNew.forward never called into the compiled "
                                   "extension; the work must be done by your kernels.",
                                   rule=rules.NO_EXTENSION, trials_passed=passed)
            if not trial.get("exact_types", False):
                return self.result(R.REJECTED, f"{label}: outputs must be plain torch.Tensor objects, got "
                                   f"{_types(trial.get('structure'))}.", rule=rules.OUTPUT_TYPE,
                                   trials_passed=passed)
            if trial.get("aliases"):
                return self.result(R.REJECTED, f"{label}: {trial['aliases'][0]}; outputs must be new tensors, "
                                   "not views of inputs.", rule=rules.OUTPUT_ALIAS, trials_passed=passed)
            if trial.get("mutated_inputs"):
                return self.result(R.REJECTED, f"{label}: ModelNew changed its input "
                                   f"{trial['mutated_inputs'][0]}; inputs must be left as they were.",
                                   rule=rules.INPUT_MUTATION, trials_passed=passed)
            if k < len(structures):
                m = compare_devices(structures[k], trial.get("structure"))
                if m:
                    return self.result(R.INCORRECT, f"{label}: {m.message}", rule=m.rule, trials_passed=passed)
            try:
                expected = torch.load(self.work / "private" / f"expected_{k}.pt", weights_only=True)
                got = torch.load(out / f"out_{k}.pt", weights_only=True)
            except Exception as exc:
                return self.result(R.RUNTIME_ERROR, f"{label}: the candidate's outputs could not be read "
                                   f"({type(exc).__name__}: {exc}).", trials_passed=passed)
            m = compare_outputs(expected, got, self.opts.atol, self.opts.rtol)
            if m:
                return self.result(R.INCORRECT, f"{label}: {m.message}", rule=m.rule, trials_passed=passed)
            passed += 1
        if not report.get("ok") or passed != self.opts.trials:
            return self.result(R.RUNTIME_ERROR, f"the candidate stopped after {passed} trials "
                               f"({run.describe()}).", trials_passed=passed)
        return self.result(R.OK, f"correct on {passed} of {self.opts.trials} trials "
                           f"(atol {self.opts.atol:g}, rtol {self.opts.rtol:g}).",
                           correct=True, reward=reward(self.opts.reward_name, True, None, self.opts.threshold),
                           trials_passed=passed)

    def static_violations(self) -> list[Any]:
        if not self.opts.static_checks:
            return []
        return check_solution(self.solution.files, device=self.device,
                              single_file=self.solution.format == SINGLE_FILE)

    def run(self) -> R.EvalResult:
        # Spares of this device started meanwhile (this evaluation's early one too) wait for
        # the end of this block before they touch the device.
        with warm.POOL.measuring(_device_key(self.opts, self.device)):
            return self._run()

    def _run(self) -> R.EvalResult:
        self.t_start = time.perf_counter()
        try:
            violations = self.static_violations()
            self.mark("static checks")
            if violations:
                # The most specific rule first: "never calls the extension" is usually a consequence.
                violations.sort(key=lambda v: v.rule == rules.NO_EXTENSION)
                first = violations[0]
                more = f" ({len(violations) - 1} more)" if len(violations) > 1 else ""
                status = R.COMPILE_ERROR if first.rule == rules.SYNTAX else R.REJECTED
                return self.result(status, str(first) + more, rule=first.rule,
                                   details={"violations": [str(v) for v in violations]})
            # The verdict needs torch here (torch.load of outputs): import it while the
            # sandboxed processes run, instead of after them.
            threading.Thread(target=_import_torch, daemon=True).start()
            self.take_spare()
            ref_thread = self.start_reference()
            self.mark("reference started")
            t0 = time.perf_counter()
            built = self.build()
            self.timings["build"] = time.perf_counter() - t0
            self.mark("built")
            if not built.ok:
                ref_thread.join()
                self.reference_outcome()  # a broken task is reported as such, even here
                return self.result(built.status, built.message, rule=built.rule,
                                   details={"build_cached": built.cached})
            # The candidate starts while the reference still computes its outputs; it waits
            # only for the inputs. Its profile phase waits for the device to be free.
            base_thread = self.plan_baseline()
            self.mark("baselines planned")
            cand: dict[str, Any] = {}
            cand_thread = threading.Thread(
                target=lambda: cand.update(zip(("run", "dir"), self.run_candidate(built.extensions), strict=True)),
                daemon=True)
            cand_thread.start()
            if base_thread is not None:
                self.schedule_device(base_thread, cand_thread, ref_thread)
                self.mark("baselines measured")
            cand_thread.join()
            self.mark("candidate ended")
            ref_thread.join()
            self.mark("reference ended")
            reference = self.reference_outcome()
            res = self.judge(cand["run"], cand["dir"], reference)
            self.mark("outputs checked")
            if res.correct and self.opts.profile:
                res = self.profile_verdict(res, cand["dir"])
                self.mark("speed judged")
            res.details.setdefault("build_cached", built.cached)
            res.details.setdefault("rebuilt", built.rebuilt)
            for k, v in self.details_extra.items():
                res.details.setdefault(k, v)
            # when each phase of the candidate process began (s since its start): where time goes
            phases = (_read_json(cand["dir"] / "out" / "report.json") or {}).get("phases_s")
            if isinstance(phases, dict):
                res.details.setdefault("candidate_phases_s", phases)
            ref_phases = (_read_json(self.work / "private" / "reference.json") or {}).get("phases_s")
            if isinstance(ref_phases, dict):
                res.details.setdefault("reference_phases_s", ref_phases)
            res.details.setdefault("evaluator_phases_s", self.marks)
            return res
        finally:
            self.timings["total"] = time.perf_counter() - self.t_start
            self.clean_up()

    def clean_up(self) -> None:
        """Processes no verdict waits for are ended, run directories removed, and the next
        evaluation's spares started (after this one's measurements)."""
        if self.spare is not None:
            for proc in self.spare.procs.values():  # not needed (a build failed): gone
                proc.kill()
                with contextlib.suppress(BaseException):
                    proc.wait()
        if self.baseline_proc is not None and self.baseline_proc.alive():
            self.baseline_proc.kill()  # a baseline no verdict waits for (the task failed)
            with contextlib.suppress(BaseException):
                self.baseline_proc.wait()
        if not self.opts.keep_run_dir:
            shutil.rmtree(self.work, ignore_errors=True)
            for d in self.baseline_dirs:
                shutil.rmtree(d, ignore_errors=True)
        if self.warm_baseline:
            with contextlib.suppress(Exception):
                warm.POOL.offer(_baseline_spare_key(self.opts, self.device, self.threads),
                                lambda: _start_baseline_spare(self.opts, self.device, self.threads))
        if self.opts.warm:
            # the next evaluation's spare, unless it was started early (`take_spare`)
            self.offer_spare()


def hash_protocol(p: timing.Protocol) -> int:
    """A small stable number for the protocol's settings (part of the baseline cache key)."""
    return int(short_hash(json.dumps(dataclasses.asdict(p), sort_keys=True), n=6), 16) % 1000


def _import_torch() -> None:
    import torch  # noqa: F401


def _types(structure: Any) -> str:
    found: list[str] = []

    def walk(s: Any) -> None:
        if isinstance(s, dict):
            if s.get("kind") in ("tensor", "other") and not s.get("exact", False):
                found.append(str(s.get("type")))
            items = s.get("items")
            if isinstance(items, list):
                for x in items:
                    walk(x)
            elif isinstance(items, dict):
                for x in items.values():
                    walk(x)

    walk(structure)
    return ", ".join(found[:3]) or "an unexpected object"


def evaluate(task: Task, solution: Solution, options: EvalOptions | None = None) -> R.EvalResult:
    """Evaluate one solution. Raises only for bad input (TaskError, SandboxUnavailable)."""
    opts = options or EvalOptions()
    if opts.sandbox:
        ok, why = sandbox.sandbox_available()
        if not ok:
            raise sandbox.SandboxUnavailable(why)
    ev = Evaluation(task, solution, opts)
    res = ev.run()
    res.timings_s = {k: round(v, 3) for k, v in ev.timings.items()}
    return res


def prefetch_baselines(task: Task, options: EvalOptions | None = None) -> str:
    """Measure and cache the task's baselines now, as its first profiled evaluation with
    these options would (same cache key), so that evaluation finds them: a long-lived
    evaluator does this when it meets a new task (the agent's service at the start of an
    episode, while the agent reads the task). Returns "cached" (there already), "measured",
    "off" (no profiling or no cache in these options) or "failed: why" (the evaluation
    that follows measures them again and reports what it finds)."""
    opts = options or EvalOptions()
    if not opts.profile or not opts.baseline_cache:
        return "off"
    if opts.sandbox:
        ok, why = sandbox.sandbox_available()
        if not ok:
            return f"failed: {why}"
    ev = Evaluation(task, Solution(files={"model_new.py": ""}, format=WORKSPACE, origin="(baselines)"), opts)
    with warm.POOL.measuring(_device_key(opts, ev.device)):
        return _prefetch(ev)


def _prefetch(ev: Evaluation) -> str:
    try:
        if BL.load(ev.baseline_key()) is not None:
            return "cached"
        ev.finish_baseline(ev.start_baseline(gated=False))
        if ev.baseline_error:
            return f"failed: {ev.baseline_error}"
        return "measured" if not (ev.baseline and ev.baseline.extra.get("compile_error")) else \
            "failed: torch.compile failed on this task (eager stands in; nothing cached)"
    finally:
        ev.clean_up()


def prebuild(task: Task, solution: Solution, options: EvalOptions | None = None) -> bool:
    """Build the solution's extension(s) into the content-hash cache, nothing else, so a
    later `evaluate` of the same files finds them built (CPU work, done ahead of the GPU
    work by the benchmark's build pool). False if it did not build; `evaluate` then
    reports why."""
    opts = options or EvalOptions()
    ev = Evaluation(task, solution, opts)
    try:
        if ev.static_violations():
            return False
        return ev.build().ok
    finally:
        shutil.rmtree(ev.work, ignore_errors=True)
