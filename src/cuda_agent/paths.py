"""Where cuda-agent keeps its caches (builds, baselines, trusted workspace records)."""

from __future__ import annotations

import hashlib
import os
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


def short_hash(*items: str | bytes, n: int = 16) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(it.encode() if isinstance(it, str) else it)
        h.update(b"\0")
    return h.hexdigest()[:n]


TEMPLATES = Path(__file__).parent / "workspace" / "templates"
