"""On-disk cache of a task's eager and torch.compile times (work in progress for the
profiling issue: not yet called by `evaluate`).

A torch.compile baseline costs seconds to build; it is measured once per
(task, device, torch version, timing protocol, compile mode, thread count) and reused.
Each evaluation re-measures eager cheaply; `drifted` says when both must be re-measured.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cuda_agent.paths import cache_dir, short_hash


@dataclass(frozen=True)
class BaselineKey:
    task_id: str
    device_name: str
    torch_version: str
    protocol_version: int
    compile_mode: str = "default"
    threads: int = 0

    @property
    def digest(self) -> str:
        return short_hash(*(str(v) for v in asdict(self).values()), n=24)


@dataclass
class Baseline:
    eager_us: dict[str, Any]  # timing.Stats as a dict
    compile_us: dict[str, Any]
    measured_at: float

    @property
    def eager_median(self) -> float:
        return float(self.eager_us["median_us"])


def _path(key: BaselineKey, root: Path | None) -> Path:
    return (root or cache_dir("baselines")) / f"{key.digest}.json"


def load(key: BaselineKey, root: Path | None = None) -> Baseline | None:
    try:
        data = json.loads(_path(key, root).read_text())
        if data.get("key") != asdict(key):
            return None
        return Baseline(eager_us=data["eager_us"], compile_us=data["compile_us"], measured_at=data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or corrupt: measure again


def store(key: BaselineKey, eager_us: dict[str, Any], compile_us: dict[str, Any], root: Path | None = None) -> Baseline:
    base = Baseline(eager_us=eager_us, compile_us=compile_us, measured_at=time.time())
    path = _path(key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": asdict(key), **asdict(base)}))
    os.replace(tmp, path)
    return base


def drifted(cached: Baseline, eager_now_us: float, bound: float = 0.10) -> bool:
    """True when today's eager median is more than `bound` (relative) off the cached one."""
    ref = cached.eager_median
    return ref <= 0 or abs(eager_now_us - ref) / ref > bound
