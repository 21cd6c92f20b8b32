"""Helpers for nested model inputs/outputs (tensors inside lists, tuples and dicts)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def tree_map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(tree_map(x, fn) for x in obj)
    if isinstance(obj, list):
        return [tree_map(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: tree_map(v, fn) for k, v in obj.items()}
    return obj


def tensors(obj: Any, path: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from tensors(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}[{k!r}]")


def to_device(obj: Any, device: torch.device, *, detach: bool = False) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.detach() if detach else t
        return t.to(device)

    return tree_map(obj, move)


def describe(obj: Any) -> Any:
    """A JSON description of an output's structure, types, shapes, dtypes and devices."""
    if isinstance(obj, torch.Tensor):
        return {
            "kind": "tensor", "type": f"{type(obj).__module__}.{type(obj).__qualname__}",
            "exact": type(obj) is torch.Tensor, "shape": list(obj.shape),
            "dtype": str(obj.dtype), "device": obj.device.type,
        }
    if isinstance(obj, (list, tuple)):
        return {"kind": type(obj).__name__ if type(obj) in (list, tuple) else f"subclass:{type(obj).__name__}",
                "items": [describe(x) for x in obj]}
    if isinstance(obj, dict):
        return {"kind": "dict", "items": {str(k): describe(v) for k, v in obj.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"kind": "scalar", "type": type(obj).__name__, "value": obj}
    return {"kind": "other", "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
