"""The agent's persistent shell: one sandboxed `bash` per episode.

State carries from one command to the next (working directory, variables, functions,
background jobs), as in a terminal. Each command is written to a file in the episode's
control directory and `source`d with stdin from /dev/null, so an unbalanced quote is a
syntax error rather than a shell waiting for more input, and no command can read the
next one. A marker line with a per-session random token ends each command's output.

A command that outlives its time-out takes the whole shell with it: the session is
killed and a fresh one started (the model is told: working directory and variables are
reset, background jobs are gone). Output is captured up to a bound, head and tail kept.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.sandbox import SandboxConfig, Session

_KEEP = 256 * 1024  # bytes kept of a command's output: head and tail halves


@dataclass
class ShellOutput:
    output: str
    exit_code: int | None  # None: timed out or the shell died
    timed_out: bool
    restarted: bool
    seconds: float
    cut_bytes: int = 0  # output bytes dropped from the middle


class ShellSession:
    def __init__(self, workspace: Path, control_dir: Path, *, readonly: list[tuple[Path, str]],
                 env: dict[str, str], sandbox: bool = True, gpu_index: int | None = None,
                 max_processes: int = 512) -> None:
        self.workspace = workspace
        self.control = control_dir
        self.readonly = readonly
        self.env = env
        self.config = SandboxConfig(enabled=sandbox, timeout_s=0, gpu_index=gpu_index,
                                    max_processes=max_processes)
        self.session: Session | None = None
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        self._n = 0
        self._token = ""
        # The sandbox dies with the thread that started it (bwrap's --die-with-parent is
        # per thread), so every start and command runs on this one long-lived thread.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-agent-shell")

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        self._token = secrets.token_hex(8)
        self._buf = bytearray()
        self._eof = False
        self.session = Session(["bash", "--noprofile", "--norc"], cwd=self.workspace,
                               writable=[self.workspace], readonly=self.readonly, env=self.env,
                               config=self.config)
        threading.Thread(target=self._reader, args=(self.session,), daemon=True).start()

    @property
    def uid(self) -> int | None:
        return self.session.uid if self.session else None

    def close(self) -> None:
        self._close_session()
        self.executor.shutdown(wait=False)

    def _close_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    async def arun(self, command: str, timeout_s: float) -> ShellOutput:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self.executor, self.run, command, timeout_s)

    def _reader(self, session: Session) -> None:
        out = session.proc.stdout
        assert out is not None
        fd = out.fileno()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._eof = True
                    self._cond.notify_all()
                    return
                self._buf += data
                self._cond.notify_all()

    # ----------------------------------------------------------------- commands

    def run(self, command: str, timeout_s: float) -> ShellOutput:
        """Run one command (call it on `executor`'s thread, e.g. through `arun`)."""
        restarted = False
        if self.session is None or not self.session.alive():
            self._close_session()
            self.start()
            restarted = self._n > 0
        assert self.session is not None and self.session.proc.stdin is not None
        self._n += 1
        script = self.control / f"cmd_{self._n}.sh"
        script.write_text(command + "\n")
        script.chmod(0o644)
        marker = f"__CUDA_AGENT_DONE_{self._token}_{self._n}"
        line = f"source {script} < /dev/null; printf '\\n{marker} %d\\n' \"$?\"\n"
        pattern = re.compile(rb"\n?" + re.escape(marker.encode()) + rb" (-?\d+)\n")
        t0 = time.monotonic()
        start = 0  # output of background jobs since the last command comes first
        try:
            self.session.proc.stdin.write(line.encode())
            self.session.proc.stdin.flush()
        except OSError:
            pass
        deadline = t0 + timeout_s
        cut = 0
        with self._cond:
            while True:
                m = pattern.search(self._buf, start)
                if m or self._eof:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # keep memory bounded for a command that prints without end
                if len(self._buf) - start > 4 * _KEEP:
                    head_end = start + _KEEP // 2
                    tail_start = len(self._buf) - _KEEP // 2
                    cut += tail_start - head_end
                    del self._buf[head_end:tail_start]
                self._cond.wait(timeout=min(left, 1.0))
            if m:
                raw = bytes(self._buf[start:m.start()])
                code: int | None = int(m.group(1))
                del self._buf[:m.end()]
            else:
                raw = bytes(self._buf[start:])
                code = None
        seconds = time.monotonic() - t0
        with_cut = _trim(raw)
        cut += with_cut[1]
        text = with_cut[0].decode(errors="replace")
        _unlink(script)
        if m:
            return ShellOutput(text, code, False, restarted, seconds, cut)
        timed_out = not self._eof
        self._close_session()  # a hung command takes the shell with it; the next command gets a new one
        return ShellOutput(text, None, timed_out, restarted, seconds, cut)


def _trim(raw: bytes) -> tuple[bytes, int]:
    if len(raw) <= _KEEP:
        return raw, 0
    half = _KEEP // 2
    return raw[:half] + b"\n" + raw[-half:], len(raw) - 2 * half


def _unlink(script: Path) -> None:
    try:
        script.unlink()
    except OSError:
        pass
