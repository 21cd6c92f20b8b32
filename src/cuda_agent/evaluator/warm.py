"""Sandboxed processes started before their job: the seconds every evaluation spends
before it does anything of its own, paid between evaluations instead.

A reference or candidate process first imports torch and creates the CUDA context; the
candidate also starts the profiler once, whose first start (CUPTI) costs seconds, more
than its trials and its timing together on a small task. None of that depends on the task
or the solution. A long-lived evaluator (the agent's evaluation service, a
bench worker) therefore keeps one *spare*, a reference process and a candidate process in
one run directory, started in the sandbox with the directories an evaluation binds, and
waiting for their spec files. An evaluation takes the spare, writes its files into those
directories and the specs last; the spare's processes then run as the usual ones would.
A spare serves one evaluation and is never reused: no candidate ever shares a process
with another candidate, and the candidate's process held no candidate code before its
job (the evaluator's clocks and the task's `Model` class come first, as always).

The next evaluation's spare is started for it with the same settings, so its start-up
overlaps the agent's thinking (or the next build) rather than the next measurement. Its
warm-up is in two stages. What touches only the host (Python, torch's libraries and the
evaluator's modules: seconds of imports) may run while this evaluation measures on
the GPU, whose device time it does not touch, so on CUDA the spare is started as soon as
this evaluation has taken its own. What touches the device (the CUDA context, the
profiler's first start), and on the CPU everything, waits for the go (`.spare-go` in its
working directory): the pool gives it once no measurement of its device is in flight
(`Pool.measuring`), or the job itself does. A spare nobody takes exits on its own after `IDLE_S`; `POOL.close()` (also
at exit) kills those still waiting.

The trusted baseline process has spares of its own (a separate key), used only when a
task's baselines are measured (a new task, or a changed device): besides torch and the
CUDA context it has imported torch.compile's machinery, compiled a trivial function (the
compiler's worker processes and caches are up) and started the profiler once, so that on
a new task the baseline's seconds are the task's compilation and timing, nothing else.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent import sandbox
from cuda_agent.evaluator.protocol import SPARE_GO, SPARE_READY
from cuda_agent.files import atomic_write

IDLE_S = 900.0  # a spare waits this long for a job, then exits


class Proc:
    """One sandboxed command run in a background thread; its deadline can move."""

    def __init__(self, argv: list[str], *, cwd: Path, writable: Sequence[Path] = (),
                 readonly: Sequence[Path | tuple[Path, str]] = (), env: Mapping[str, str] | None = None,
                 config: sandbox.SandboxConfig, timeout_s: float,
                 on_exit: Callable[[], object] | None = None, preload: Sequence[str] = ()) -> None:
        self.deadline = sandbox.Deadline(time.monotonic() + timeout_s)
        self.result: sandbox.RunResult | None = None
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self._on_exit = on_exit  # called once the process has ended (releases what it held)
        self._thread = threading.Thread(
            target=self._go, args=(argv, cwd, list(writable), list(readonly), env, config, tuple(preload)),
            daemon=True, name="cuda-agent-sandboxed")
        self._thread.start()

    def _go(self, argv: list[str], cwd: Path, writable: list[Path], readonly: list[Path | tuple[Path, str]],
            env: Mapping[str, str] | None, config: sandbox.SandboxConfig, preload: tuple[str, ...]) -> None:
        try:
            self.result = sandbox.run(argv, cwd=cwd, writable=writable, readonly=readonly, env=env,
                                      config=config, deadline=self.deadline, preload=preload)
        except BaseException as exc:  # handed to whoever waits
            self.error = exc
        finally:
            if self._on_exit is not None:
                with contextlib.suppress(BaseException):
                    self._on_exit()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> sandbox.RunResult:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def kill(self) -> None:
        self.deadline.at = 0.0


def wait_retrying(proc: Proc, from_spare: bool, job_reached: Callable[[], bool],
                  restart: Callable[[], Proc]) -> tuple[sandbox.RunResult, Proc, str | None]:
    """Wait for `proc`. A spare's process that ended before its job reached it (not the
    job's doing) is replaced by a cold one, waited for in turn. Returns the run, the
    process that gave it, and how the spare ended (None: no retry)."""
    run = proc.wait()
    if not from_spare or job_reached() or run.timed_out:
        return run, proc, None
    failed = run.describe()
    proc = restart()
    return proc.wait(), proc, failed


@dataclass
class Spare:
    work: Path  # the run directory its processes were started on
    procs: dict[str, Proc] = field(default_factory=dict)  # "reference", "candidate" (or "baseline")
    started: float = field(default_factory=time.monotonic)
    ready_dirs: tuple[str, ...] = ("run", "private")  # its processes' working directories
    device: Hashable = None  # what its device stage must not overlap (see `Pool.measuring`)
    released: bool = False  # its processes were given the go
    released_at: float = 0.0  # when (time.monotonic())

    def release(self) -> None:
        """Give its processes the go for their device stage (once)."""
        if self.released or not self.procs:
            return
        self.released, self.released_at = True, time.monotonic()
        for d in self.ready_dirs:
            with contextlib.suppress(OSError):
                atomic_write(self.work / d / SPARE_GO, "")

    def usable(self) -> bool:
        """All its processes still up (not exited, not killed) and inside their idle time."""
        return bool(self.procs) and all(p.alive() for p in self.procs.values()) \
            and time.monotonic() - self.started < IDLE_S - 30

    def ready(self) -> bool:
        """Whether its processes have warmed up and wait (each marks its working directory)."""
        return self.usable() and all((self.work / d / SPARE_READY).exists() for d in self.ready_dirs)

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
        for p in self.procs.values():
            with contextlib.suppress(BaseException):
                p.wait()
        if self.procs:
            shutil.rmtree(self.work, ignore_errors=True)


class Pool:
    """At most one spare per key (device, GPU, threads, sandbox settings)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spares: dict[Hashable, Spare] = {}
        self._closed = False
        self._measuring: dict[Hashable, int] = {}  # device -> measurements in flight
        self.taken = 0  # evaluations that found a spare (for tests and benchmarks)

    @contextlib.contextmanager
    def measuring(self, device: Hashable) -> Iterator[None]:
        """While inside, spares of `device` offered meanwhile are held before their device
        stage; the last measurement of the device to leave gives them the go."""
        with self._lock:
            self._measuring[device] = self._measuring.get(device, 0) + 1
        try:
            yield
        finally:
            with self._lock:  # (under the lock: no measurement starts while they are given it)
                self._measuring[device] -= 1
                if not self._measuring[device]:
                    del self._measuring[device]
                    for s in self._spares.values():
                        if s.device == device:
                            s.release()

    def take(self, key: Hashable) -> Spare | None:
        with self._lock:
            spare = self._spares.get(key)
            if spare is None or not spare.procs:  # none, or one still being started
                return None
            del self._spares[key]
        if not spare.usable():
            threading.Thread(target=spare.close, daemon=True).start()
            return None
        with self._lock:
            self.taken += 1
        return spare

    def offer(self, key: Hashable, start: Callable[[], Spare]) -> None:
        """Start a spare for `key` unless one is there already; it gets the go at once
        unless a measurement of its device is in flight."""
        with self._lock:
            if self._closed or key in self._spares:
                return
            self._spares[key] = placeholder = Spare(work=Path())
        try:
            spare = start()
        except BaseException:
            with self._lock:
                self._spares.pop(key, None)
            raise
        with self._lock:
            if self._closed or self._spares.get(key) is not placeholder:
                threading.Thread(target=spare.close, daemon=True).start()
                return
            self._spares[key] = spare
            if not self._measuring.get(spare.device):
                spare.release()

    def close(self) -> None:
        """Kill every spare still waiting (the pool takes no new ones after this)."""
        with self._lock:
            self._closed = True
            spares, self._spares = list(self._spares.values()), {}
        for s in spares:
            if s.procs:
                s.close()

    def wait_ready(self, key: Hashable, timeout_s: float) -> bool:
        """Wait until the spare for `key` is ready (benchmarks: as after an agent's thinking)."""
        return self._wait(lambda spares: key in spares and spares[key].ready(), timeout_s)

    def wait_all_ready(self, timeout_s: float) -> bool:
        """Wait until every spare in the pool is ready (benchmarks: as after an agent's
        thinking); False when there is none, or after `timeout_s`."""
        return self._wait(lambda spares: bool(spares) and all(s.ready() for s in spares.values()), timeout_s)

    def _wait(self, done: Callable[[dict[Hashable, Spare]], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                spares = dict(self._spares)
            if done(spares):
                return True
            time.sleep(0.05)
        return False

POOL = Pool()
atexit.register(POOL.close)
