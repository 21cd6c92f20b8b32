"""Process limits and the uid handover: the unprivileged uid a root caller's sandbox runs
as (and the `setpriv` that switches to it), the trees chowned to it and given back, the
kill of all its processes, rlimits through prlimit(1), and the run's cgroup (a root
caller's process and memory limits, and whether the run reached them)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from cuda_agent.sandbox.config import DEFAULT_PATH, MIB, SandboxConfig

log = logging.getLogger(__package__)

# Unprivileged uids handed to sandboxes when the caller is root: [base, base + span).
_UID_BASE = 0x60000000
_UID_SPAN = 1 << 20


# --------------------------------------------------------------------------- uids and rlimits


def dropper_prefix(uid: int, groups: Sequence[int]) -> list[str] | None:
    """Inside bwrap (still uid 0), switch to `uid` for good before exec'ing the command."""
    setpriv = shutil.which("setpriv", path=DEFAULT_PATH)
    if setpriv is None:
        return None
    grp = ["--groups", ",".join(str(g) for g in groups)] if groups else ["--clear-groups"]
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", *grp, "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


def _uid_map_contains(uid: int, path: str) -> bool:
    try:
        with open(path) as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                if inside <= uid < inside + count:
                    return True
    except (OSError, ValueError):
        return True  # no map to read: assume the usual full identity map
    return False


_uid_counter = itertools.count()


def allocate_uid() -> int:
    """A per-run unprivileged uid, so concurrent sandboxes don't share a process budget."""
    for _ in range(64):
        uid = _UID_BASE + (os.getpid() * 4099 + next(_uid_counter)) % _UID_SPAN
        if _uid_map_contains(uid, "/proc/self/uid_map") and _uid_map_contains(uid, "/proc/self/gid_map"):
            return uid
    return 65534  # a user namespace without the high range: fall back to nobody


def _proc_statuses() -> Iterator[tuple[int, dict[str, list[str]]]]:
    """(pid, fields) for every process in /proc: each status line's value split on
    whitespace, by its name (`Uid` -> real, effective, saved, fs uid)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            fields: dict[str, list[str]] = {}
            for line in lines:
                name, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(name, value.split())
            yield int(entry.name), fields


def count_user_tasks(uid: int) -> int:
    """Tasks (processes and threads) whose real uid is `uid`, as RLIMIT_NPROC counts."""
    total = 0
    for _pid, fields in _proc_statuses():
        try:
            real = int(fields["Uid"][0]) if "Uid" in fields else None
            threads = int(fields["Threads"][0]) if "Threads" in fields else None
        except (ValueError, IndexError):
            continue
        if real == uid:
            total += threads or 1
    return total


def rlimits(config: SandboxConfig, nproc: int | None) -> dict[int, int]:
    lim = {resource.RLIMIT_FSIZE: max(1, config.max_file_size_mb) * MIB, resource.RLIMIT_CORE: 0}
    if nproc is not None:
        lim[resource.RLIMIT_NPROC] = max(1, nproc)
    if config.address_space_mb is not None:
        lim[resource.RLIMIT_AS] = max(1, config.address_space_mb) * MIB
    return lim


_PRLIMIT_FLAGS = {resource.RLIMIT_FSIZE: "--fsize", resource.RLIMIT_CORE: "--core",
                  resource.RLIMIT_NPROC: "--nproc", resource.RLIMIT_AS: "--as"}


def prlimit_prefix(limits: Mapping[int, int]) -> list[str] | None:
    prlimit = shutil.which("prlimit", path=DEFAULT_PATH)
    if prlimit is None:
        return None
    return [prlimit, *(f"{_PRLIMIT_FLAGS[k]}={v}:{v}" for k, v in limits.items()), "--"]


def limits_preexec(limits: Mapping[int, int]) -> Callable[[], None]:
    def apply() -> None:  # only used where prlimit(1) is missing
        for k, v in limits.items():
            resource.setrlimit(k, (v, v))

    return apply


# --------------------------------------------------------------------------- ownership (root)


def _walk(top: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under `top` (itself included), not following symlinks nor crossing
    into other file systems."""
    try:
        st = os.lstat(top)
    except OSError:
        return
    yield str(top), st
    if not stat.S_ISDIR(st.st_mode):
        return
    dev = st.st_dev
    stack = [str(top)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                est = e.stat(follow_symlinks=False)
            except OSError:
                continue
            yield e.path, est
            if stat.S_ISDIR(est.st_mode) and est.st_dev == dev:
                stack.append(e.path)


class Ownership:
    """Hands the writable trees to the sandbox uid for one run and takes them back."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.saved: dict[str, tuple[int, int]] = {}
        self.tops: list[tuple[Path, tuple[int, int]]] = []

    def take(self, tops: Sequence[Path]) -> None:
        for top in tops:
            st = os.lstat(top)
            self.tops.append((top, (st.st_uid, st.st_gid)))
            for path, est in _walk(top):
                if stat.S_ISREG(est.st_mode) and est.st_nlink > 1:
                    continue  # a hard link may be shared with a file outside: leave it
                self.saved[path] = (est.st_uid, est.st_gid)
                with contextlib.suppress(OSError):
                    os.lchown(path, self.uid, self.uid)

    def restore(self) -> None:
        for top, default in self.tops:
            for path, est in _walk(top):
                if est.st_uid != self.uid and est.st_gid != self.uid:
                    continue
                owner = self.saved.get(path, default)
                with contextlib.suppress(OSError):
                    os.lchown(path, *owner)
                if stat.S_ISREG(est.st_mode) and est.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    self._strip_setid(path)

    @staticmethod
    def _strip_setid(path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
        except OSError:
            pass
        finally:
            os.close(fd)


def kill_uid(uid: int, deadline_s: float = 3.0) -> None:
    """SIGKILL every process whose real or effective uid is `uid` (the sandbox's own)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = False
        for pid, fields in _proc_statuses():
            zombie = fields.get("State", [])[:1] == ["Z"]
            if str(uid) in fields.get("Uid", [])[:2] and not zombie:
                found = True
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if not found:
            return
        time.sleep(0.01)


# --------------------------------------------------------------------------- the run's cgroup (root)

PROCESSES = "processes"  # RunResult.limit: the process limit was reached
MEMORY = "memory"  # RunResult.limit: the kernel killed for the memory limit


class RunCgroup:
    """One run's cgroup, where the caller is root and a cgroup file system is writable: a
    process limit (`pids.max`) whose reach is itself a verdict (`pids.events`: a fork that
    failed there), and a limit on the run's memory (resident and swap, page cache and
    tmpfs included), which the kernel enforces by killing inside the group only and
    counts (`oom_kill`). A memory cgroup limits what is used, not what is reserved, so
    CUDA's large address-space reservations are untouched (RLIMIT_AS would break them).
    v1 (one hierarchy per controller) and v2 (one for all)."""

    _counter = itertools.count()

    def __init__(self, dirs: dict[str, Path], v2: bool) -> None:
        self.dirs = dirs  # controller ("pids", "memory") -> its directory
        self.v2 = v2
        self._forks_failed_at_kill: int | None = None  # (forks refused by our own kill do not count)

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def join_prefix(self) -> list[str]:
        """argv prefix that moves the command into the group before it execs (exit 125 if it cannot)."""
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *self.procs_files, "--"]

    @classmethod
    def create(cls, max_pids: int | None, memory_bytes: int | None) -> RunCgroup | None:
        want = {k: v for k, v in (("pids", max_pids), ("memory", memory_bytes)) if v is not None}
        if os.geteuid() != 0 or not want:
            return None
        try:
            with open("/proc/self/mounts") as f:
                mounts = [line.split() for line in f]
        except OSError:
            return None
        name = f"cuda-agent-{os.getpid()}-{next(cls._counter)}"
        group = cls({}, v2=False)
        for m in mounts:  # v1: a hierarchy per controller
            if len(m) >= 4 and m[2] == "cgroup":
                for ctl in set(m[3].split(",")) & set(want) - set(group.dirs):
                    path = Path(m[1]) / cls._own_v1_path(ctl).lstrip("/") / name
                    if cls._make(path, ctl, want[ctl], v2=False):
                        group.dirs[ctl] = path
        if not group.dirs:
            for m in mounts:  # v2: one directory for every controller it has
                if len(m) >= 4 and m[2] == "cgroup2":
                    ctls = [c for c in want if cls._v2_enable(Path(m[1]), c)]
                    path = Path(m[1]) / name
                    if ctls and cls._make(path, ctls[0], want[ctls[0]], v2=True):
                        group = cls({ctls[0]: path}, v2=True)
                        for c in ctls[1:]:
                            if cls._limit(path, c, want[c], v2=True):
                                group.dirs[c] = path
                        break
        return group if group.dirs else None

    @classmethod
    def available(cls, controller: str = "pids") -> bool:
        """Whether a run can get a cgroup with `controller` ("pids" or "memory") here."""
        group = cls.create(8, 64 << 20 if controller == "memory" else None)
        if group is None:
            return False
        group.remove()
        return controller in group.dirs

    @staticmethod
    def _make(path: Path, ctl: str, value: int, v2: bool) -> bool:
        try:
            path.mkdir()
        except OSError:
            return False
        if RunCgroup._limit(path, ctl, value, v2):
            return True
        with contextlib.suppress(OSError):
            path.rmdir()
        return False

    @staticmethod
    def _limit(path: Path, ctl: str, value: int, v2: bool) -> bool:
        try:
            if ctl == "pids":
                (path / "pids.max").write_text(str(max(1, value)))
            elif v2:
                (path / "memory.max").write_text(str(value))
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(value))
                with contextlib.suppress(OSError):  # swap accounting: off for the group
                    (path / "memory.memsw.limit_in_bytes").write_text(str(value))
            return True
        except OSError:
            return False

    @staticmethod
    def _own_v1_path(controller: str) -> str:
        with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
            for line in f:
                _hid, controllers, path = line.rstrip("\n").split(":", 2)
                if controller in controllers.split(","):
                    return path
        return "/"

    @staticmethod
    def _v2_enable(mnt: Path, controller: str) -> bool:
        try:
            if controller not in (mnt / "cgroup.controllers").read_text().split():
                return False
            control = mnt / "cgroup.subtree_control"
            if controller not in control.read_text().split():
                control.write_text(f"+{controller}")
            return True
        except OSError:
            return False

    def _count(self, ctl: str, file: str, key: str) -> int:
        d = self.dirs.get(ctl)
        if d is None:
            return 0
        with contextlib.suppress(OSError, ValueError):
            for line in (d / file).read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
        return 0

    def limit_hit(self) -> str | None:
        """Which limit the run reached: MEMORY (the kernel killed in the group for it),
        PROCESSES (a fork failed at the group's process limit), or None."""
        if self._count("memory", "memory.events" if self.v2 else "memory.oom_control", "oom_kill"):
            return MEMORY
        failed = self._count("pids", "pids.events", "max")
        if self._forks_failed_at_kill is not None:
            failed = min(failed, self._forks_failed_at_kill)
        return PROCESSES if failed else None

    def pids(self) -> list[int]:
        found: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(x) for x in Path(f).read_text().split())
        return sorted(found)

    def kill(self, deadline_s: float = 3.0) -> None:
        if self._forks_failed_at_kill is None:
            self._forks_failed_at_kill = self._count("pids", "pids.events", "max")
        if "pids" in self.dirs:
            with contextlib.suppress(OSError):
                (self.dirs["pids"] / "pids.max").write_text("0")  # no new forks while we kill
        if self.v2:
            for d in set(self.dirs.values()):
                if (d / "cgroup.kill").exists():
                    with contextlib.suppress(OSError):
                        (d / "cgroup.kill").write_text("1")
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        for d in set(self.dirs.values()):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                log.warning("could not remove cgroup %s", d)
