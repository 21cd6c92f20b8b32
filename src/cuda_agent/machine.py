"""What this process may use of the machine."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not all the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """CUDA devices visible to this process (1 where there are none: one CPU slot)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    except Exception:
        return 1
