"""Where cuda-agent keeps its caches (builds, baselines, trusted workspace records)."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """`$CUDA_AGENT_CACHE`, else `$XDG_CACHE_HOME/cuda-agent`, else `~/.cache/cuda-agent`."""
    env = os.environ.get("CUDA_AGENT_CACHE")
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "cuda-agent"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def cache_dir(*parts: str) -> Path:
    d = cache_root().joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


def runs_root() -> Path:
    """Where evaluations keep their run directories (trial inputs and outputs): `$CUDA_AGENT_RUNS`,
    else the cache's `runs/`. A tmpfs (/dev/shm) makes large tensors cheap to pass between
    the processes of an evaluation; what they write there counts as their memory."""
    env = os.environ.get("CUDA_AGENT_RUNS")
    root = Path(env) if env else cache_root() / "runs"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


@contextmanager
def private_slot(root: Path) -> Iterator[Path]:
    """A subdirectory of `root` that no other holder (thread or process) uses while this
    one holds it: `root/slot-K` for the lowest K whose lock file, `root/slot-K.lock`
    (outside the slot, out of a sandbox's reach), is free. For caches that sandboxed runs
    write to: a sandbox run as root owns its writable trees for the run (see `sandbox`),
    so two runs at once must never share one. The slot's contents persist for the next."""
    for k in itertools.count():
        fh = open(root / f"slot-{k}.lock", "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            continue
        try:
            slot = root / f"slot-{k}"
            slot.mkdir(exist_ok=True)
            yield slot
            return
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()


def short_hash(*items: str | bytes, n: int = 16) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(it.encode() if isinstance(it, str) else it)
        h.update(b"\0")
    return h.hexdigest()[:n]


TEMPLATES = Path(__file__).parent / "workspace" / "templates"
