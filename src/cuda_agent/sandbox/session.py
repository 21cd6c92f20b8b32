"""`Session`: a sandboxed process that stays up (the agent's shell)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from cuda_agent.sandbox.config import SandboxConfig
from cuda_agent.sandbox.process import Launch
from cuda_agent.sandbox.runner import working_bwrap


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
        bwrap, features = working_bwrap(config)
        self._stack = contextlib.ExitStack()
        try:
            self._launch = self._stack.enter_context(Launch.prepare(
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
        return not self._closed and not Launch.exited(self.proc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._launch.kill_tree(self.proc)
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

