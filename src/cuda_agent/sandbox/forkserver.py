"""A fork server: Python processes that start in a sandbox with torch already imported.

Importing torch costs a fresh process seconds of CPU (2.4 s on a 2-core machine), and the
evaluator starts two or three sandboxed Python processes per evaluation. A fork server is
a trusted process, started once per environment by the evaluator's own process, that has
imported torch and the modules it was asked to preload (never touching CUDA: a process
that has cannot fork usefully). For each job it forks a child that *enters* a sandbox
bubblewrap has made for that job, and runs the job's module there as `python -m` would.

What bubblewrap does for a command it execs, the sandbox's holder here (a `sleep` that
bwrap runs, as the run's uid, after its set-up has finished), the forked child does for
itself, in this order, before any of the job's code runs:

1. the child (still root) closes every descriptor but the job's own, joins the run's
   cgroups (its process and memory limits), sets the run's rlimits and joins the holder's
   IPC, UTS, network, cgroup, PID and mount namespaces (`setns`; the mount namespace
   brings the sandbox's root and nothing else of the host);
2. it forks once more (a PID namespace takes children only); the grandchild starts a
   session, asks to die with its parent, drops every capability from its bounding set,
   switches to the run's uid and groups for good (which empties its capability sets),
   sets no-new-privileges, checks all of that in /proc/self/status, goes to the job's
   working directory, puts /dev/null and the job's output pipes on 0, 1 and 2, closes
   everything else and takes the job's environment, then runs the module;
3. the child waits for it and writes its wait status to the job's status pipe, which the
   trusted side reads as the command's end (then it kills the holder and with it the
   namespace, as when a bwrap command ends).

The job's code cannot reach the server or the child: they are root, outside its PID
namespace, hold no descriptor it has, and its parent's pid reads as 0. Used only where the
caller is root (the case in which bwrap's command is dropped to a per-run uid by setpriv);
elsewhere, and whenever the server cannot be started or refuses (threads or CUDA up after
its imports), a run execs as before; CUDA_AGENT_FORKSERVER=0 turns them off. `run_server`
is the server process's main.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Environment variables that vary per run and matter only once the job runs (CUDA reads
# its variables at its initialisation, which the server never reaches): a server serves
# every environment that differs from its own only in these.
LATE_ENV = ("CUDA_VISIBLE_DEVICES", "TMPDIR", "HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
NAMESPACES = ("ipc", "uts", "net", "cgroup", "pid", "mnt")  # joined in this order
_START_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_ENTER_FAILED = 125  # the grandchild's exit code when entering the sandbox failed


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# --------------------------------------------------------------------------- the server


def _fork_problem() -> str | None:
    """Why this process must not fork jobs (None: it may)."""
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = threading.active_count()
    if tasks != 1:
        return f"{tasks} threads after the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports"
    return None


def run_server(fd: int, preload: Sequence[str]) -> int:
    # (no parent-death signal: it follows the thread that started the server, not the
    # process; the server ends when its socket's other end is closed)
    sock = socket.socket(fileno=fd)
    import importlib

    problem = None
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # reported, then the caller execs its runs
            problem = f"importing {name}: {exc!r}"
            break
    problem = problem or _fork_problem()
    sock.send(json.dumps({"ready": problem is None, "problem": problem}).encode())
    if problem:
        return 1
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped by the kernel
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 16)
        except OSError:
            return 0
        if not msg:  # the caller is gone
            return 0
        try:
            req = json.loads(msg)
            pid = os.fork()
        except BaseException as exc:
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"error": repr(exc)}).encode())
            continue
        if pid == 0:
            _child(req, fds, sock.fileno())  # never returns
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"pid": pid}).encode())


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _child(req: dict[str, Any], fds: list[int], server_fd: int) -> None:
    """In the forked child (root): join the run's cgroups, limits and namespaces, fork the
    job into the PID namespace, report its wait status."""
    status_w = fds[0]
    try:
        os.close(server_fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        libc = _libc()
        _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        out_w, err_w, ns_fds = fds[1], fds[2], fds[3:]
        _close_all_but(set(fds) | {0, 1, 2})  # (the server's /dev/null and log: the job's pipes come above them)
        for path in req["cgroup_procs"]:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        import resource

        for k, v in req["rlimits"].items():
            resource.setrlimit(int(k), (v, v))
        if len(ns_fds) != len(NAMESPACES):
            raise ValueError(f"{len(ns_fds)} namespace descriptors for {len(NAMESPACES)} namespaces")
        for name, fd in zip(NAMESPACES, ns_fds, strict=True):
            _check(libc.setns(fd, 0), f"setns({name})")
            os.close(fd)
        entered_r, entered_w = os.pipe()  # the job says here that it is in, or why not
        pid = os.fork()
        if pid == 0:
            os.close(status_w)
            os.close(entered_r)
            _job(req, out_w, err_w, entered_w)  # never returns
        for fd in (out_w, err_w, entered_w):
            os.close(fd)
        _pid, status = os.waitpid(pid, 0)
        said = os.read(entered_r, 4096)
        if said != b"in":
            why = said.decode(errors="replace") or f"it ended first ({os.waitstatus_to_exitcode(status)})"
            raise RuntimeError(f"the job did not enter the sandbox: {why}")
        os.write(status_w, f"status {status}".encode())
        os._exit(0)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            os.write(status_w, f"error {exc!r}".encode())
        os._exit(1)


def _status_fields() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return {k.strip(): v.strip() for k, _s, v in (line.partition(":") for line in f)}


def _job(req: dict[str, Any], out_w: int, err_w: int, entered_w: int) -> None:
    """In the grandchild, inside the PID namespace: drop to the run's uid for good, take
    the job's descriptors, directory and environment, run its module."""
    try:
        libc = _libc()
        os.setsid()
        _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        uid, groups = int(req["uid"]), [int(g) for g in req["groups"]]
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        for cap in range(last_cap + 1):
            _check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(CAPBSET_DROP, {cap})")
        os.setgroups(groups)
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        st = _status_fields()
        caps = {k: st.get(k) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        if any(v is None or int(v, 16) for v in caps.values()) or st.get("NoNewPrivs") != "1" \
                or st.get("Uid", "").split() != [str(uid)] * 4 or os.getgroups() != groups:
            raise RuntimeError(f"privileges not dropped: {caps}, {st.get('NoNewPrivs')}, {st.get('Uid')}")
        os.chdir(req["cwd"])
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.write(entered_w, b"in")
        _close_all_but({0, 1, 2})
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            os.write(entered_w, repr(exc).encode()[:4000])
        os._exit(_ENTER_FAILED)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ["PWD"] = req["cwd"]  # as bwrap's --chdir sets it
    import random
    import tempfile

    random.seed()  # not the server's sequence
    tempfile.tempdir = None  # found again from the job's TMPDIR
    _set_threads()
    sys.argv = [req["module"], *req["args"]]
    sys.path[0] = os.getcwd()  # as `python -m` has it
    code = _run_module(req["module"])
    os._exit(code)


def _run_module(module: str) -> int:
    """Run `module` as __main__ and end as the interpreter would: its exit code, atexit
    handlers, streams flushed."""
    import atexit as _atexit
    import runpy
    import traceback

    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    with contextlib.suppress(BaseException):
        _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code & 0xFF


# --------------------------------------------------------------------------- the caller's side


@dataclass(frozen=True)
class Job:
    """What the server needs to start one job in a sandbox its holder already made."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    groups: list[int]
    rlimits: dict[int, int]
    cgroup_procs: list[str]

    def message(self) -> bytes:
        return json.dumps({"module": self.module, "args": self.args, "env": self.env, "cwd": self.cwd,
                           "uid": self.uid, "groups": self.groups,
                           "rlimits": {str(k): v for k, v in self.rlimits.items()},
                           "cgroup_procs": self.cgroup_procs}).encode()


def _log_file() -> Any:
    """Where a server's own stderr goes: CUDA_AGENT_FORKSERVER_LOG (appended), else nowhere."""
    path = os.environ.get("CUDA_AGENT_FORKSERVER_LOG")
    return open(path, "ab") if path else subprocess.DEVNULL  # noqa: SIM115 (closed once the server has it)


class ServerError(RuntimeError):
    pass


class Server:
    """One fork server process and the socket to it."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str]) -> None:
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        log = _log_file()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from cuda_agent.sandbox.forkserver import run_server; "
                 "sys.exit(run_server(int(sys.argv[1]), sys.argv[2:]))", str(theirs.fileno()), *preload],
                env=dict(env), cwd="/", pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                log.close()  # (the server holds its own copy)
        ours.settimeout(_START_TIMEOUT_S)
        try:
            hello = json.loads(ours.recv(65536) or b"{}")
        except (OSError, ValueError) as exc:
            self.close()
            raise ServerError(f"the fork server did not start: {exc!r}") from exc
        if not hello.get("ready"):
            self.close()
            raise ServerError(f"the fork server refused: {hello.get('problem') or 'it ended'}")
        ours.settimeout(30.0)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def spawn(self, job: Job, fds: Sequence[int]) -> int:
        """Hand `job` and its descriptors (status pipe, stdout, stderr, then one per
        namespace in `NAMESPACES` order) to the server; the forked child's pid."""
        with self._lock:
            try:
                socket.send_fds(self._sock, [job.message()], list(fds))
                reply = json.loads(self._sock.recv(65536) or b"{}")
            except (OSError, ValueError) as exc:
                raise ServerError(f"the fork server did not answer: {exc!r}") from exc
        if "pid" not in reply:
            raise ServerError(f"the fork server could not fork: {reply.get('error') or 'it ended'}")
        return int(reply["pid"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(timeout=10)


_servers: dict[tuple[Any, ...], Server | str] = {}  # key -> server, or why it could not start
_servers_lock = threading.Lock()
_key_locks: dict[tuple[Any, ...], threading.Lock] = {}


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The server's own environment for jobs of `env`: without the late variables, and
    with one OpenMP thread (a pool's threads, made at torch's import, would not survive
    the fork; each job sets its own count, `_set_threads`)."""
    out = {k: v for k, v in env.items() if k not in LATE_ENV}
    out["OMP_NUM_THREADS"] = "1"
    return out


def _set_threads() -> None:
    """The thread count a fresh process with the job's environment would have: its
    OMP_NUM_THREADS, else every usable core (OpenMP's default)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        n = 0
    torch.set_num_threads(n if n > 0 else max(1, len(os.sched_getaffinity(0))))


def server_for(env: Mapping[str, str], preload: Sequence[str]) -> Server | None:
    """The running server for this environment and preload (started on first use), or
    None where one cannot run (then remembered, and the caller execs)."""
    start_env = server_env(env)
    key = (tuple(sorted(start_env.items())), tuple(preload), sys.executable)
    with _servers_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        with _servers_lock:
            found = _servers.get(key)
        if isinstance(found, str):
            return None
        if found is not None and found.alive():
            return found
        try:
            server: Server | str = Server(start_env, preload)
        except (OSError, ServerError) as exc:
            server = str(exc)
        with _servers_lock:
            _servers[key] = server
        return server if isinstance(server, Server) else None


def forget(server: Server) -> None:
    """Drop a server that failed a job (the next job starts a new one)."""
    with _servers_lock:
        for k, v in list(_servers.items()):
            if v is server:
                del _servers[k]
    server.close()


def close_all() -> None:
    with _servers_lock:
        servers = [v for v in _servers.values() if isinstance(v, Server)]
        _servers.clear()
    for s in servers:
        s.close()


atexit.register(close_all)

