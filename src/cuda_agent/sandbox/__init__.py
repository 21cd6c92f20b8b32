"""Run untrusted commands (candidate builds and benchmarks) in a bubblewrap sandbox.

`run` starts one command with a clean environment, rlimits, a wall-clock timeout that
kills the whole process tree, and bounded capture of stdout/stderr. With
`SandboxConfig.enabled` (the default) the command also runs under `bwrap`:

- no network (`--unshare-net`), own PID/IPC/UTS namespaces, `--new-session`,
  `--die-with-parent`;
- a read-only view of the system (/usr, /etc, /opt, /bin..., the Python prefixes and
  every sys.path entry), a fresh /proc, a minimal /dev, a private size-capped /tmp;
- nothing else of the host (home, /work, the host's /tmp) unless passed in `writable`
  (read-write, same path) or `readonly` (read-only, same path or `(src, dst)`).

The process limit uses RLIMIT_NPROC, which Linux does not enforce for uid 0. So when
the caller is root, the command runs as a fresh unprivileged uid (one per run, from a
high range; `setpriv` inside bwrap does the switch), the `writable` trees are chowned to
that uid for the run and given back afterwards (setuid/setgid bits stripped), and every
process of that uid is killed at the end. As a non-root caller the limit counts all the
caller's processes (also across bwrap's user namespace), so it is set to "what the
caller runs now + max_processes". As root, each run also gets a cgroup of its own (v1 or
v2, where one can be created): its process limit, whose reach ends the run at once (a
fork bomb would otherwise hold every core until the time-out; `RunResult.limit`), and
`SandboxConfig.memory_mb`, enforced by the kernel inside the group only (it counts what
is used, not what is reserved, so CUDA's address-space reservations are untouched). With
`enabled=False` as root without such a cgroup there is no process limit.

See README.md beside this file for the details and the caveats.
"""

from __future__ import annotations

from cuda_agent.sandbox.config import Deadline, RunResult, SandboxConfig, SandboxUnavailable
from cuda_agent.sandbox.limits import MEMORY, PROCESSES
from cuda_agent.sandbox.runner import find_bwrap, run, sandbox_available
from cuda_agent.sandbox.session import Session

__all__ = [
    "MEMORY",
    "PROCESSES",
    "Deadline",
    "RunResult",
    "SandboxConfig",
    "SandboxUnavailable",
    "Session",
    "find_bwrap",
    "run",
    "sandbox_available",
]
