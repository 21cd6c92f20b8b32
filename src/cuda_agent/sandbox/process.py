"""Launching one command: `Launch` puts the bwrap command line, the limits and the uid
handover together, runs the command with its output pumped through `Capture` (head and
tail kept) against a movable deadline, and kills the whole tree at the end."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cuda_agent.sandbox import forkserver
from cuda_agent.sandbox.bwrap import (
    SYSTEM_DIRS,
    Features,
    abs_path,
    build_env,
    bwrap_args,
    check_writable,
    gpu_nodes,
    is_under,
    python_paths,
)
from cuda_agent.sandbox.config import MIB, Deadline, RunResult, SandboxConfig, SandboxUnavailable
from cuda_agent.sandbox.limits import (
    PROCESSES,
    Ownership,
    RunCgroup,
    allocate_uid,
    count_user_tasks,
    dropper_prefix,
    kill_uid,
    limits_preexec,
    prlimit_prefix,
    rlimits,
)

log = logging.getLogger(__package__)

_DRAIN_GRACE_S = 1.0  # how long to keep reading pipes after the command ended
_READ_CHUNK = 1 << 16
_WATCH_S = 0.2  # how often a run with a pids cgroup is checked for a refused fork
_HOLDER_READY_S = 60.0  # how long bwrap may take to set up a fork server job's sandbox
# Why fork servers are not used in this process (set by the first failure to enter a sandbox).
_forking_disabled: str | None = None


# --------------------------------------------------------------------------- output capture


class Capture:
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


class Launch:
    """One prepared command: argv, environment and the state to undo afterwards."""

    def __init__(self, config: SandboxConfig, sandboxed: bool) -> None:
        self.config = config
        self.sandboxed = sandboxed
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.popen_cwd = "/"
        self.preexec: Callable[[], None] | None = None
        self.uid: int | None = None
        self.ownership: Ownership | None = None
        self.cgroup: RunCgroup | None = None
        self.private_dir: str | None = None
        self.info_r: int | None = None
        self.info_w: int | None = None
        self._info = b""
        self._child: int | None = None
        self.limit: str | None = None  # the limit the run was stopped at (RunResult.limit)
        # a Python module run by a fork server (see forkserver): the job, the preload and
        # the holder's command line (it says "up" on its stdout once the sandbox is made)
        self.fork_job: forkserver.Job | None = None
        self.preload: tuple[str, ...] = ()
        self.holder_argv: list[str] = []
        self._limits: dict[int, int] = {}
        self._groups: list[int] = []
        self._sandbox_prefix: list[str] = []

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
        features: Features | None,
        preload: Sequence[str] = (),
    ) -> Iterator[Launch]:
        launch = cls(config, sandboxed=bwrap is not None)
        try:
            launch._setup(list(argv), cwd, writable, readonly, env, bwrap, features)
            if preload:
                launch._plan_fork(list(argv), tuple(preload), cwd)
            yield launch
        finally:
            launch._cleanup()

    def _setup(self, argv: list[str], cwd: Path, writable: Sequence[Path],
               readonly: Sequence[Path | tuple[Path, str]], env: Mapping[str, str] | None,
               bwrap: str | None, features: Features | None) -> None:
        config = self.config
        cwd = abs_path(cwd)
        if not cwd.is_dir():
            raise ValueError(f"cwd {cwd} is not a directory")
        rw = [abs_path(p) for p in writable]
        for p in rw:
            if not p.exists():
                raise ValueError(f"writable path {p} does not exist")
            check_writable(p)
        ro: list[tuple[Path, Path]] = []
        for item in readonly:
            src, dst = (item if isinstance(item, tuple) else (item, item))
            src, dst = abs_path(src), abs_path(dst)
            if not src.exists():
                raise ValueError(f"readonly path {src} does not exist")
            ro.append((src, dst))
        root = os.geteuid() == 0
        if root:
            # the run's own cgroup: its process limit (reaching it ends the run) and memory
            memory = config.memory_mb * MIB if config.memory_mb is not None else None
            self.cgroup = RunCgroup.create(config.max_processes, memory)

        if bwrap is not None:
            assert features is not None
            home = tmp = "/tmp"
            if root:
                # with a pids cgroup, it is the limit that bites (and says so); the uid's
                # rlimit stays as a second line
                nproc: int | None = config.max_processes + (16 if self.cgroup and "pids" in self.cgroup.dirs else 0)
            else:
                nproc = count_user_tasks(os.getuid()) + config.max_processes
        else:
            self.private_dir = tempfile.mkdtemp(prefix="cuda-agent-run-")
            home = tmp = self.private_dir
            nproc = None if root else count_user_tasks(os.getuid()) + config.max_processes
        self.env = build_env(env, config, home, tmp)
        limits = self._limits = rlimits(config, nproc)
        prefix = prlimit_prefix(limits)
        if prefix is None:
            prefix, self.preexec = [], limits_preexec(limits)

        if root and (self.cgroup is None or "pids" not in self.cgroup.dirs) and bwrap is None:
            log.warning("--no-sandbox as root without a pids cgroup: no process limit")
        if self.cgroup is not None:
            prefix = self.cgroup.join_prefix() + prefix
        if bwrap is None:
            self.popen_cwd = str(cwd)
            self.argv = prefix + argv
            return

        visible = rw + [dst for _src, dst in ro] + [Path(d) for d in SYSTEM_DIRS] + python_paths()
        if cwd != Path("/") and not any(is_under(cwd, v) for v in visible):
            raise ValueError(f"cwd {cwd} would not exist in the sandbox: pass it (or a parent) "
                             "in writable or readonly")
        inner: list[str] = []
        if root:
            self.uid = allocate_uid()
            groups: list[int] = []
            if config.gpu_index is not None:
                groups = sorted({os.stat(n).st_gid for n in gpu_nodes(config.gpu_index, Path("/dev"))} - {0})
            dropper = dropper_prefix(self.uid, groups)
            if dropper is None:
                raise SandboxUnavailable("running as root needs setpriv (util-linux)")
            inner = dropper
            self.ownership = Ownership(self.uid)
            self.ownership.take(rw)
        self.info_r, self.info_w = os.pipe()
        os.set_blocking(self.info_r, False)
        args = bwrap_args(bwrap=bwrap, cwd=cwd, writable=rw, readonly=ro, config=config,
                          features=features, unprivileged=not root)
        args[1:1] = ["--info-fd", str(self.info_w)]
        self.argv = prefix + args + inner + argv
        self._groups = groups if root else []
        self._sandbox_prefix = prefix + args + inner

    def _plan_fork(self, argv: list[str], preload: tuple[str, ...], cwd: Path) -> None:
        """Run `python -m MODULE ARGS` through a fork server, where one can be used: the
        sandbox as root (its holder is dropped to the run's uid like any command), no
        forking disabled in this process."""
        if (not self.sandboxed or self.uid is None or _forking_disabled is not None or len(argv) < 3
                or argv[:2] != [sys.executable, "-m"] or os.environ.get("CUDA_AGENT_FORKSERVER") == "0"):
            return
        # (it lives until its stdin, a pipe only the caller holds, closes: with the caller,
        # should the caller die without ending it)
        self.holder_argv = self._sandbox_prefix + ["/bin/sh", "-c", "echo up; exec cat >/dev/null"]
        self.preload = preload
        self.fork_job = forkserver.Job(
            module=argv[2], args=argv[3:], env=dict(self.env), cwd=str(abs_path(cwd)), uid=self.uid,
            groups=list(self._groups), rlimits=dict(self._limits),
            cgroup_procs=self.cgroup.procs_files if self.cgroup is not None else [])

    def _cleanup(self) -> None:
        for fd in (self.info_r, self.info_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.info_r = self.info_w = None
        if self.uid is not None:
            kill_uid(self.uid)
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
        if self.fork_job is not None and not stdin:
            forked = self._execute_forked(t0, deadline, moving)
            if forked is not None:
                return forked
        out, err = Capture(self.config.max_output_bytes), Capture(self.config.max_output_bytes)
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
            assert proc.stdout is not None and proc.stderr is not None
            timed_out = self._pump([(proc.stdout.fileno(), out), (proc.stderr.fileno(), err)],
                                   proc.stdin, stdin, self._pidfd(proc.pid), lambda: self.exited(proc),
                                   lambda: self.kill_tree(proc), deadline, moving)
        finally:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            if self.cgroup is not None:  # (before the kill, whose refused forks are ours)
                self.limit = self.limit or self.cgroup.limit_hit()
            self.kill_tree(proc)
            try:
                rc: int | None = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): give up on it
                rc = None
        duration = time.monotonic() - t0
        if timed_out or rc is None:
            returncode, sig = None, None
        else:
            returncode, sig = _decode_status(rc, self.sandboxed)
        if self.limit is not None:
            timed_out = False  # stopped at a limit, not by the clock (kill-on-limit ends it early)
        return RunResult(returncode=returncode, stdout=out.text(), stderr=err.text(),
                         timed_out=timed_out, duration_s=duration, signal=sig,
                         sandboxed=self.sandboxed, limit=self.limit)

    @staticmethod
    def _pidfd(pid: int) -> int | None:
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def _pump(self, readers: list[tuple[int, Capture]], stdin_file: Any, stdin: bytes | None,
              exit_fd: int | None, ended: Callable[[], bool], kill: Callable[[], None],
              deadline_at: Deadline, moving: bool = False) -> bool:
        """Feed stdin, capture output, watch the clock until `ended()`; `exit_fd` (closed
        here) turns readable at the end. True if the timeout hit."""
        sel = selectors.DefaultSelector()
        try:
            for fd, cap in readers:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ, cap)
            pending = memoryview(stdin or b"")
            if stdin_file is not None:
                os.set_blocking(stdin_file.fileno(), False)
                sel.register(stdin_file.fileno(), selectors.EVENT_WRITE, None)
            if exit_fd is not None:
                sel.register(exit_fd, selectors.EVENT_READ, "exit")
            timed_out = False
            ended_at: float | None = None
            deadline = deadline_at.at
            watch = self.cgroup is not None and "pids" in self.cgroup.dirs
            next_watch = 0.0
            while True:
                now = time.monotonic()
                if moving and not timed_out:
                    deadline = deadline_at.at
                if watch and ended_at is None and now >= next_watch:
                    # a fork refused at the process limit: a fork bomb, stopped now rather
                    # than at the time-out (it would hold every core until then)
                    next_watch = now + _WATCH_S
                    assert self.cgroup is not None
                    if self.cgroup.limit_hit() == PROCESSES:
                        self.limit = PROCESSES
                        kill()
                        ended_at = now
                if ended_at is None and ended():
                    ended_at = now
                    kill()  # nothing may outlive the command
                if ended_at is None and now >= deadline:
                    if timed_out:  # killed 10 s ago and still not gone
                        return True
                    timed_out = True
                    kill()
                    deadline = now + 10.0
                    continue
                readers_left = [k for k in sel.get_map().values() if isinstance(k.data, Capture)]
                if ended_at is not None and (not readers_left or now >= ended_at + _DRAIN_GRACE_S):
                    return timed_out
                wait = deadline - now if ended_at is None else ended_at + _DRAIN_GRACE_S - now
                if exit_fd is None and ended_at is None:
                    wait = min(wait, 0.05)
                if moving and ended_at is None:
                    wait = min(wait, Deadline.POLL_S)
                if watch and ended_at is None:
                    wait = min(wait, _WATCH_S)
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
                            stdin_file.close()
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
            if exit_fd is not None:
                os.close(exit_fd)

    def _execute_forked(self, t0: float, deadline: Deadline, moving: bool) -> RunResult | None:
        """Run the fork job: bwrap makes the sandbox around a holder, a fork server's child
        enters it and runs the module (see forkserver). None when the job could not be
        handed over before any of its code ran: the caller then execs it as usual."""
        global _forking_disabled
        assert self.fork_job is not None
        server = forkserver.server_for(self.env, self.preload)
        if server is None:
            return None
        out, err = Capture(self.config.max_output_bytes), Capture(self.config.max_output_bytes)
        try:
            proc = subprocess.Popen(
                self.holder_argv, cwd=self.popen_cwd, env=self.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=(self.info_w,) if self.info_w is not None else (), preexec_fn=self.preexec)
        except OSError:
            return None
        if self.info_w is not None:
            os.close(self.info_w)
            self.info_w = None
        mine: list[int] = []  # our ends, closed at the end
        handed = False
        try:
            up = self._wait_holder(proc, deadline)
            pid1 = self._child_pid() if up else None
            if pid1 is None:  # bwrap failed to set up (its own words are the result)
                return self._finish_unforked(proc, t0)
            status_r, status_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            mine += [status_r, out_r, err_r]
            theirs = [status_w, out_w, err_w]
            try:
                theirs += [os.open(f"/proc/{pid1}/ns/{n}", os.O_RDONLY) for n in forkserver.NAMESPACES]
                server.spawn(self.fork_job, theirs)
                handed = True
            except (OSError, forkserver.ServerError) as exc:
                log.warning("fork server: %s; this run and the next exec", exc)
                forkserver.forget(server)
                return None
            finally:
                for fd in theirs:
                    os.close(fd)
            status = b""

            def ended() -> bool:
                nonlocal status
                if status:
                    return True
                try:
                    status = os.read(status_r, 4096) or b"gone"
                except BlockingIOError:
                    return False
                return True

            assert proc.stdout is not None and proc.stderr is not None
            readers = [(out_r, out), (err_r, err), (proc.stdout.fileno(), err), (proc.stderr.fileno(), err)]
            os.set_blocking(status_r, False)
            mine.remove(status_r)
            timed_out = False
            text = ""
            try:
                # (the holder's end ends the namespace and all in it, the job's whole tree;
                # the run's cgroup is left as it is until the job is known to have run)
                timed_out = self._pump(readers, None, None, status_r, ended, lambda: self._kill_holder(proc),
                                       deadline, moving)
                text = status.decode(errors="replace")
                if text.startswith("error "):
                    # the child could not enter the sandbox: nothing of the job ran
                    _forking_disabled = text[6:]
                    log.warning("fork server disabled in this process: %s", _forking_disabled)
                    handed = False
                    return None
            finally:
                if handed:
                    if self.cgroup is not None:
                        self.limit = self.limit or self.cgroup.limit_hit()
                    self.kill_tree(proc)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=30)
            returncode: int | None = None
            sig: int | None = None
            if text.startswith("status ") and not timed_out:
                returncode = os.waitstatus_to_exitcode(int(text[7:]))
                if returncode < 0:
                    sig = -returncode
            elif not timed_out:  # the child was killed with the tree before it could say
                returncode, sig = -signal.SIGKILL, signal.SIGKILL
            if self.limit is not None:
                timed_out = False
            return RunResult(returncode=returncode, stdout=out.text(), stderr=err.text(), timed_out=timed_out,
                             duration_s=time.monotonic() - t0, signal=sig, sandboxed=True, limit=self.limit)
        finally:
            if not handed:
                self._kill_holder(proc)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
            for fd in mine:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _kill_holder(self, proc: subprocess.Popen[bytes]) -> None:
        """End the holder's sandbox (its namespace, and so all in it) without touching the
        run's cgroup, which a run exec'd after a failed handover still needs."""
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._wait_namespace()

    def _wait_holder(self, proc: subprocess.Popen[bytes], deadline: Deadline) -> bool:
        """Wait until the holder says the sandbox is up (False: bwrap ended, or too slow)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        said = b""
        end = min(deadline.at, time.monotonic() + _HOLDER_READY_S)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while time.monotonic() < end and len(said) < 3:
                if sel.select(timeout=0.05):
                    try:
                        chunk = os.read(fd, 3 - len(said))
                    except BlockingIOError:
                        continue
                    if not chunk:
                        return False
                    said += chunk
                elif proc.poll() is not None:
                    return False
        return said == b"up\n"

    def _finish_unforked(self, proc: subprocess.Popen[bytes], t0: float) -> RunResult:
        """The result of a holder whose bwrap ended (or hung) before the sandbox was up."""
        self._kill_holder(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                os.set_blocking(stream.fileno(), True)
        try:
            stdout, stderr = proc.communicate(timeout=30)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            stdout, stderr, rc = b"", b"", None
        returncode, sig = _decode_status(rc, True) if rc is not None else (None, None)
        return RunResult(returncode=returncode, stdout=stdout.decode(errors="replace"),
                         stderr=stderr.decode(errors="replace"), timed_out=False,
                         duration_s=time.monotonic() - t0, signal=sig, sandboxed=True, limit=self.limit)

    @staticmethod
    def exited(proc: subprocess.Popen[bytes]) -> bool:
        """Whether the command ended, without reaping it (its pid stays ours to kill)."""
        if proc.returncode is not None:
            return True
        try:
            res = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return res is not None and res.si_pid != 0

    def kill_tree(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.returncode is None:  # not reaped: the group id cannot have been reused
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
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
