"""Runtime guards active while `ModelNew.forward` runs in the candidate process.

- every ATen operator that reaches the dispatcher (from Python or from C++ `at::`/`torch::`
  calls in the binding, which go through the same dispatcher) is checked against an
  allowlist of allocation, view and metadata operators;
- every public `torch.nn.functional` callable raises;
- calls into the candidate's extension modules are counted (a solution must use them).

These are the authority; the static checks only give earlier, more precise messages.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_agent.evaluator import rules

# Allocation, views, metadata and plain data movement. Everything else is compute.
ALLOWED_OPS = frozenset(
    """
    empty empty_like empty_strided empty_permuted new_empty new_empty_strided zeros zeros_like
    ones ones_like full full_like new_zeros new_ones new_full scalar_tensor arange fill_ zero_
    view _unsafe_view reshape _reshape_alias expand expand_as permute transpose t squeeze
    unsqueeze flatten unflatten select slice narrow as_strided alias detach unbind split
    split_with_sizes chunk view_as contiguous clone copy_ _to_copy lift_fresh lift_fresh_copy
    resize_ set_ sym_size sym_stride sym_numel sym_storage_offset is_contiguous dim size stride
    _has_compatible_shallow_copy_type record_stream is_same_size is_nonzero
    """.split()
)
CROSS_DEVICE_CHECKED = frozenset({"copy_", "_to_copy"})


class GuardViolation(RuntimeError):
    """Raised inside the candidate's forward when it breaks a rule; also recorded."""


@dataclass
class GuardReport:
    compute_ops: list[str] = field(default_factory=list)
    functional_calls: list[str] = field(default_factory=list)
    extension_calls: int = 0
    ops_seen: dict[str, int] = field(default_factory=dict)

    def first_violation(self) -> tuple[str, str] | None:
        if self.functional_calls:
            return (rules.FUNCTIONAL,
                    f"torch.nn.functional.{self.functional_calls[0]} was called during ModelNew.forward; "
                    "the rules forbid torch compute in model_new.py: implement it as a kernel.")
        if self.compute_ops:
            ops = sorted(set(self.compute_ops))
            return (rules.TORCH_COMPUTE,
                    f"torch compute operator {self.compute_ops[0]} ran during ModelNew.forward "
                    f"(all: {', '.join(ops[:8])}); only allocation, views and the extension's own "
                    "kernels are allowed, in Python and in the C++ binding alike.")
        return None


def _devices(args: Iterable[Any]) -> set[str]:
    out: set[str] = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            out.add(a.device.type)
        elif isinstance(a, torch.device):
            out.add(a.type)
        elif isinstance(a, (list, tuple)):
            out |= _devices(a)
    return out


class ComputeOpGuard(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled inside this mode; without this, torch wraps __torch_dispatch__
        # in a dynamo-disable that imports torch._dynamo (a slow import) on first use.
        return False

    def __init__(self, report: GuardReport) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.report.ops_seen[name] = self.report.ops_seen.get(name, 0) + 1
        bad = name not in ALLOWED_OPS
        if not bad and name in CROSS_DEVICE_CHECKED:
            devs = _devices(args) | _devices(kwargs.values())
            bad = len(devs) > 1
            if bad:
                name = f"{name} (device transfer {'/'.join(sorted(devs))})"
        if bad:
            self.report.compute_ops.append(f"aten.{name}")
            raise GuardViolation(f"torch operator aten.{name} is not allowed in ModelNew.forward")
        return func(*args, **kwargs)


@contextmanager
def block_functional(report: GuardReport) -> Iterator[None]:
    originals: dict[str, Any] = {}
    for name in dir(F):
        if name.startswith("_"):
            continue
        attr = getattr(F, name)
        if not callable(attr) or isinstance(attr, type) or isinstance(attr, types.ModuleType):
            continue
        originals[name] = attr

        def blocked(*args: Any, __name: str = name, **kwargs: Any) -> Any:
            report.functional_calls.append(__name)
            raise GuardViolation(f"torch.nn.functional.{__name} is not allowed in ModelNew.forward")

        setattr(F, name, blocked)
    try:
        yield
    finally:
        for name, attr in originals.items():
            setattr(F, name, attr)


def extension_callables(modules: Iterable[types.ModuleType]) -> tuple[set[int], set[str]]:
    ids: set[int] = set()
    names: set[str] = set()
    for m in modules:
        names.add(m.__name__)
        for v in vars(m).values():
            if callable(v):
                ids.add(id(v))
    return ids, names


@contextmanager
def count_extension_calls(report: GuardReport, modules: Iterable[types.ModuleType]) -> Iterator[None]:
    ids, names = extension_callables(modules)
    previous = sys.getprofile()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and (id(arg) in ids or getattr(arg, "__module__", None) in names):
            report.extension_calls += 1

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


@contextmanager
def guarded(report: GuardReport, modules: Iterable[types.ModuleType]) -> Iterator[None]:
    with count_extension_calls(report, modules), block_functional(report), ComputeOpGuard(report):
        yield


def call_guarded(fn: Callable[..., Any], args: list[Any], report: GuardReport,
                 modules: Iterable[types.ModuleType]) -> Any:
    with torch.no_grad(), guarded(report, list(modules)):
        return fn(*args)
