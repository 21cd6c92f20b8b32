"""Compare a candidate's outputs with the reference's, in the trusted parent process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cuda_agent.evaluator import rules
from cuda_agent.machine import usable_cores


@dataclass
class Mismatch:
    rule: str
    message: str


# The error's norm may be at most this share of the reference's: an output whose every
# element is within atol of the reference can still ignore its input when the reference's
# values are all smaller than atol (a wide softmax, say, whose outputs are ~1/width: zeros
# pass atol = 1e-2 there, and have an error norm equal to the reference's own).
REL_NORM = 0.2


def _fmt(x: float) -> str:
    return f"{x:.6g}"


_threads_lock = threading.Lock()


@contextlib.contextmanager
def few_threads() -> Iterator[None]:
    """torch's intra-op threads, for the comparisons: at most a quarter of the usable cores
    (and 4), restored afterwards. The comparisons run beside sandboxed processes that
    start (the next evaluation's spares import torch meanwhile); with as many threads as
    cores, every small parallel op waits for a descheduled thread, and those waits, not
    the comparisons, make up the time of checking an evaluation's outputs. The lock keeps
    two evaluations' comparisons from restoring each other's count."""
    with _threads_lock:
        before = torch.get_num_threads()
        want = max(1, min(before, usable_cores() // 4, 4))
        if want != before:
            torch.set_num_threads(want)
        try:
            yield
        finally:
            if want != before:
                torch.set_num_threads(before)


_CHUNK = 1 << 16  # elements per piece of the fast path: its float64 temporaries stay in cache


def _all_close(exp: torch.Tensor, got: torch.Tensor, atol: float, rtol: float) -> tuple[float, float] | None:
    """(norm of the reference, norm of the difference) when every element of `got` is
    finite and within atol + rtol * |exp| of a finite `exp`: the usual case, checked in
    pieces small enough to stay in cache, in float64. Anything else (a NaN or Inf
    anywhere, a value out of tolerance, a sum that overflows) is left to the full
    diagnosis (None)."""
    e_all, g_all = exp.reshape(-1), got.reshape(-1)
    ref_sq = err_sq = 0.0
    for lo in range(0, e_all.numel(), _CHUNK):
        e = e_all[lo:lo + _CHUNK].to(torch.float64)
        g = g_all[lo:lo + _CHUNK].to(torch.float64)
        diff = (e - g).abs_()
        ok = diff <= e.abs().mul_(rtol).add_(atol)  # NaN compares False
        # an Inf in `e` makes its tolerance Inf: a finite `g` there would pass; the sum catches it
        if not bool(ok.all()) or not bool(torch.isfinite(diff.sum())):
            return None
        ref_sq += float(torch.dot(e, e))
        err_sq += float(torch.dot(diff, diff))
    return ref_sq ** 0.5, err_sq ** 0.5


def compare_tensors(path: str, exp: torch.Tensor, got: torch.Tensor, atol: float, rtol: float) -> Mismatch | None:
    if tuple(exp.shape) != tuple(got.shape):
        return Mismatch(rules.SHAPE, f"{path} has shape {list(got.shape)}, expected {list(exp.shape)}.")
    if exp.dtype != got.dtype:
        return Mismatch(rules.DTYPE, f"{path} has dtype {got.dtype}, expected {exp.dtype}.")
    if exp.numel() == 0:
        return None
    if exp.dtype == torch.bool or not (exp.is_floating_point() or exp.is_complex()):
        bad = exp != got
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            return Mismatch(rules.VALUES, f"{path} differs at index {idx}: expected {exp[idx].item()}, "
                            f"got {got[idx].item()} ({int(bad.sum())} of {exp.numel()} elements differ).")
        return None
    close = None if exp.is_complex() else _all_close(exp, got, atol, rtol)
    if close is not None:
        return _relative_error(path, *close)
    e = exp.to(torch.float64) if not exp.is_complex() else exp.to(torch.complex128)
    g = got.to(e.dtype)
    for name, fn in (("NaN", torch.isnan), ("+Inf", lambda t: torch.isposinf(t.real)),
                     ("-Inf", lambda t: torch.isneginf(t.real))):
        me, mg = fn(e), fn(g)
        if not torch.equal(me, mg):
            bad = me != mg
            idx = tuple(int(i) for i in bad.nonzero()[0])
            where = "has" if bool(mg[idx]) else "lacks"
            return Mismatch(rules.NONFINITE, f"{path} {where} {name} at index {idx} where the reference "
                            f"has {_fmt(e[idx].item()) if not e.is_complex() else e[idx].item()} "
                            f"({int(bad.sum())} of {e.numel()} elements disagree on {name}).")
    finite = torch.isfinite(e) & torch.isfinite(g)
    diff = (e - g).abs()
    tol = atol + rtol * e.abs()
    bad = finite & (diff > tol)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        n = int(bad.sum())
        maxd = float(diff[finite].max())
        return Mismatch(rules.VALUES, (
            f"{path} mismatch at index {idx}: expected {_fmt(e[idx].real.item())}, got {_fmt(g[idx].real.item())} "
            f"(|diff| {_fmt(diff[idx].item())} > atol {atol:g} + rtol {rtol:g} * |expected|); "
            f"{n} of {e.numel()} elements ({100.0 * n / e.numel():.3g}%) out of tolerance, max |diff| {_fmt(maxd)}."
        ))
    return _relative_error(path, float(torch.linalg.vector_norm(e[finite])),
                           float(torch.linalg.vector_norm(diff[finite])))


def _relative_error(path: str, ref: float, err: float) -> Mismatch | None:
    """Elementwise within tolerance, but is the error (`err`, the norm of the difference
    over the finite elements) small beside the reference's own norm (`ref`)? An all-zero
    reference has no scale to measure against."""
    if ref == 0.0 or err <= REL_NORM * ref:
        return None
    return Mismatch(rules.RELATIVE_ERROR, (
        f"{path} is within atol of the reference element by element, but its error is {err / ref:.3g} of the "
        f"reference's own size (norm of the difference {_fmt(err)}, of the reference {_fmt(ref)}; at most "
        f"{REL_NORM:g} passes): the reference's values are smaller than atol, so the output must follow them, "
        "not just stay near zero."))


def compare_outputs(exp: Any, got: Any, atol: float, rtol: float, path: str = "output") -> Mismatch | None:
    """The first way `got` differs from the reference's `exp`, or None."""
    with few_threads():
        return _compare(exp, got, atol, rtol, path)


def _compare(exp: Any, got: Any, atol: float, rtol: float, path: str) -> Mismatch | None:
    if isinstance(exp, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return Mismatch(rules.STRUCTURE, f"{path} is {type(got).__name__}, expected a tensor.")
        return compare_tensors(path, exp, got, atol, rtol)
    if isinstance(exp, (list, tuple)):
        if not isinstance(got, (list, tuple)) or type(got) is not type(exp):
            return Mismatch(rules.STRUCTURE, f"{path} is {type(got).__name__}, expected {type(exp).__name__}.")
        if len(got) != len(exp):
            return Mismatch(rules.STRUCTURE, f"{path} has {len(got)} items, expected {len(exp)}.")
        for i, (a, b) in enumerate(zip(exp, got, strict=True)):
            m = _compare(a, b, atol, rtol, f"{path}[{i}]")
            if m:
                return m
        return None
    if isinstance(exp, dict):
        if not isinstance(got, dict) or set(got) != set(exp):
            return Mismatch(rules.STRUCTURE, f"{path} has keys {sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__}, expected {sorted(map(str, exp))}.")
        for key in exp:
            m = _compare(exp[key], got[key], atol, rtol, f"{path}[{key!r}]")
            if m:
                return m
        return None
    if isinstance(exp, float) and isinstance(got, (int, float)):
        if abs(exp - got) > atol + rtol * abs(exp):
            return Mismatch(rules.VALUES, f"{path} is {got}, expected {exp}.")
        return None
    if exp != got or type(exp) is not type(got):
        return Mismatch(rules.STRUCTURE, f"{path} is {got!r}, expected {exp!r}.")
    return None


def compare_devices(exp_struct: Any, got_struct: Any, path: str = "output") -> Mismatch | None:
    """Devices are compared on the descriptions, since outputs travel as CPU copies."""
    if isinstance(exp_struct, dict) and exp_struct.get("kind") == "tensor":
        if isinstance(got_struct, dict) and got_struct.get("kind") == "tensor":
            if exp_struct["device"] != got_struct["device"]:
                return Mismatch(rules.DEVICE, f"{path} is on {got_struct['device']}, expected {exp_struct['device']}.")
        return None
    if isinstance(exp_struct, dict) and isinstance(got_struct, dict):
        ei, gi = exp_struct.get("items"), got_struct.get("items")
        if isinstance(ei, list) and isinstance(gi, list):
            for i, (a, b) in enumerate(zip(ei, gi, strict=False)):
                m = compare_devices(a, b, f"{path}[{i}]")
                if m:
                    return m
        elif isinstance(ei, dict) and isinstance(gi, dict):
            for k in ei:
                if k in gi:
                    m = compare_devices(ei[k], gi[k], f"{path}[{k!r}]")
                    if m:
                        return m
    return None
