"""On-disk cache of a task's eager and torch.compile times.

A torch.compile baseline costs seconds to build; it is measured once per
(task, device, torch version, timing protocol, compile mode, thread count) by the
trusted baseline process and reused. Each evaluation re-measures eager beside the
candidate, beside a fixed device probe; `drifted` says when both baselines must be
measured again.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from cuda_agent.files import atomic_write
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
    eager: dict[str, Any]  # timing.Measurement.summary(): {"device": Stats, "wall": Stats, "kernels"}
    compile: dict[str, Any]
    measured_at: float
    extra: dict[str, Any] = field(default_factory=dict)  # copy bandwidth, compile time and errors

    @property
    def eager_median(self) -> float:
        return float(self.eager["device"]["median_us"])

    @property
    def compile_median(self) -> float:
        return float(self.compile["device"]["median_us"])

    @property
    def probe_median(self) -> float | None:
        """The device probe's median where the baselines were measured (None: not probed)."""
        try:
            return float(self.extra["probe"]["device"]["median_us"])
        except (KeyError, TypeError, ValueError):
            return None


def _path(key: BaselineKey, root: Path | None) -> Path:
    return (root or cache_dir("baselines")) / f"{key.digest}.json"


def load(key: BaselineKey, root: Path | None = None) -> Baseline | None:
    try:
        data = json.loads(_path(key, root).read_text())
        if data.get("key") != asdict(key):
            return None
        base = Baseline(eager=data["eager"], compile=data["compile"], measured_at=float(data["measured_at"]),
                        extra=dict(data.get("extra") or {}))
        base.eager_median, base.compile_median  # noqa: B018  (a malformed entry is a miss)
        return base
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or corrupt: measure again


def store(key: BaselineKey, eager: dict[str, Any], compile: dict[str, Any], root: Path | None = None,
          extra: dict[str, Any] | None = None) -> Baseline:
    base = Baseline(eager=eager, compile=compile, measured_at=time.time(), extra=dict(extra or {}))
    path = _path(key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"key": asdict(key), **asdict(base)}))
    return base


EAGER_STALE_BOUND = 0.5  # eager this far off the cache re-measures, whatever the probe says


def drifted(cached: Baseline, eager_now_us: float, probe_now_us: float | None = None,
            bound: float = 0.10) -> bool:
    """True when the baselines must be measured again: the device probe beside the
    candidate is more than `bound` (relative) off the probe where the baselines were
    measured (the device is not what it was), or eager is more than `EAGER_STALE_BOUND`
    (or `bound`, if larger) off (a stale entry). Without a probe on either side, eager against `bound`.

    Eager alone is a poor probe: on a small task its time varies between processes far
    more than torch.compile's and the candidate's, so comparing eager with `bound`
    re-measured the baselines on most evaluations of such tasks (and, through the scale in
    `speed`, cut speedups)."""
    ref = cached.eager_median
    if ref <= 0:
        return True
    eager_off = abs(eager_now_us - ref) / ref
    probe_ref = cached.probe_median
    if probe_ref is None or probe_now_us is None:
        return eager_off > bound
    return (probe_ref <= 0 or abs(probe_now_us - probe_ref) / probe_ref > bound
            or eager_off > max(EAGER_STALE_BOUND, bound))


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return str(torch.__version__)


_gpu_names: dict[int, str] = {}  # nvidia-smi's answers, once per process and GPU


def device_name(device: str, gpu_index: int = 0) -> str:
    """A name for the cache key, found without creating a CUDA context in this process.
    A GPU's name is asked of nvidia-smi once per process (every evaluation needs it, and
    nvidia-smi can take a second); a failed query is not kept."""
    if device == "cuda":
        name = _gpu_names.get(gpu_index, "")
        if not name:
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", str(gpu_index)],
                                     capture_output=True, text=True, timeout=30)
                name = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
            except (OSError, subprocess.TimeoutExpired, IndexError):
                name = ""
            if name:
                _gpu_names[gpu_index] = name
        return name or "cuda"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}"
