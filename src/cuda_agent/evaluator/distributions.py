"""Trials on other input distributions, and whether a task's outputs follow its inputs.

Five trials of `get_inputs()` cannot tell a kernel from a constant when the task's output
hardly moves as its inputs are redrawn (the mean squared error of two `torch.rand`
tensors is 1/6 to three digits), nor from a formula that reads a summary of the inputs
(KernelBench's "analytical hack": the expected loss of uniform inputs from one mean). So
besides the task's own trials, each evaluation runs trials whose floating-point inputs
come from other distributions of the same shapes and dtypes (`redistribute`):

- `scaled`: the task's values scaled by a factor of 2 to 4 (up or down) and shifted by
  0.5 to 1.5 of their spread; values in [0, 1] mapped into a random part of [0, 1];
- `normal`: a normal distribution, its location and scale moved as in `scaled`;
- `heavy-tailed`: Student's t with 3 degrees of freedom, at the task's location, 1 to 3
  times its spread, with one value in about 4096 64 spreads further out (what a
  kernel that reads a sample of its input misses).

Each keeps the sign the task's values had: non-negative ones stay non-negative, non-positive
ones non-positive, so a log or a square root keeps its argument; values in [0, 1] stay in
[0, 1] in the `scaled` trial (a probability keeps its meaning there, and the other two
trials test the task beyond it). Tensors that
are not floating point (indices, masks), hold one element, or hold only whole numbers
(labels stored as floats) keep the task's values, as do numbers that are not tensors.

A distribution trial where the reference's output is not finite (where the task's own
was), or where the reference raises, is skipped and recorded (`judged_output`, the one
rule the reference and the baseline process apply).
`barely_varies` says when a task's outputs across its own trials are all within the
tolerance of each other: its verdicts then rest on the distribution trials. The data
pipeline (`datagen.check`) drops such tasks with the same function.

The reference process, the baseline process and the data pipeline build a trial's
inputs with `make_inputs`; the candidate only ever loads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

TASK = ""  # the task's own get_inputs()
DISTRIBUTIONS = ("scaled", "normal", "heavy-tailed")
SPIKE_EVERY, SPIKE_SIZE = 4096, 64.0  # the heavy-tailed trial's rare far values


def plan(n: int) -> list[str]:
    """The distributions of `n` distribution trials, in turn."""
    return [DISTRIBUTIONS[i % len(DISTRIBUTIONS)] for i in range(n)]


def describe(distribution: str) -> str:
    return "the task's get_inputs()" if distribution == TASK else f"the {distribution} distribution"


def make_inputs(get_inputs: Callable[[], Any], seed: int, distribution: str) -> list[Any]:
    """Trial inputs: `get_inputs()` under `seed`, redistributed unless `distribution` is TASK."""
    from cuda_agent.evaluator.tensors import seed_all

    seed_all(seed)
    values = get_inputs()
    inputs = list(values) if isinstance(values, (list, tuple)) else [values]
    return redistribute(inputs, distribution, seed) if distribution != TASK else inputs


def redistribute(inputs: list[Any], distribution: str, seed: int) -> list[Any]:
    """`inputs` with every continuous floating-point tensor drawn anew from `distribution`
    (same shape, dtype and device), deterministic in `seed`."""
    import torch

    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown input distribution {distribution!r}; one of {', '.join(DISTRIBUTIONS)}")
    gen = torch.Generator().manual_seed((seed * 7_919 + DISTRIBUTIONS.index(distribution) + 1) % (1 << 63))
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and _continuous(x):
            x = _draw(x, distribution, gen).to(dtype=x.dtype, device=x.device)
        out.append(x)
    return out


def _continuous(x: Any) -> bool:
    import torch

    if not x.is_floating_point() or x.numel() < 2:
        return False
    v = x.detach().float()
    finite = torch.isfinite(v)
    return bool(finite.all()) and not bool(torch.equal(v, v.round()))


def _uniform(gen: Any, lo: float, hi: float) -> float:
    import torch

    return lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _away(gen: Any, lo: float, hi: float) -> float:
    """A random magnitude in [lo, hi], either sign: a draw that is never close to 0."""
    return _uniform(gen, lo, hi) * (1.0 if _uniform(gen, 0.0, 1.0) < 0.5 else -1.0)


def _draw(x: Any, distribution: str, gen: Any) -> Any:
    """New values for `x` (on the CPU, in float32, or float64 for a float64 `x`) in `x`'s
    domain: the scale moves by a factor of 2 to 4 either way and the location by 0.5 to 1.5
    of the task's spread, so no output stays where the task's own inputs put it."""
    import torch

    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.detach().to("cpu", work, copy=True)  # (changed in place below)
    lo, hi = float(v.min()), float(v.max())
    sample = v.reshape(-1)[: 1 << 24].double()
    mean, std = float(sample.mean()), float(sample.std())
    std = std if std > 0 else max(abs(mean), 1.0)
    factor = math.exp(_away(gen, math.log(2.0), math.log(4.0)))
    shift = _away(gen, 0.5, 1.5) * std
    if distribution == "scaled":
        if 0.0 <= lo and hi <= 1.0:  # in [0, 1]: into a random part of it
            width = _uniform(gen, 0.2, 0.6)
            return v.sub_(lo).div_(max(hi - lo, 1e-12)).mul_(width).add_(_uniform(gen, 0.0, 1.0 - width))
        y = v.mul_(factor).add_(shift)
        if lo >= 0:
            return y.sub_(min(float(y.min()), 0.0))
        if hi <= 0:
            return y.sub_(max(float(y.max()), 0.0))
        return y
    del v, sample
    z = torch.randn(x.shape, generator=gen, dtype=work)
    if distribution == "heavy-tailed":
        # Student's t, 3 degrees of freedom, unit variance; and one value in SPIKE_EVERY (on
        # average) SPIKE_SIZE times further out: what one element in thousands carries
        # decides the answer, so a kernel that reads part of its input is off
        chi2 = torch.zeros(x.shape, dtype=work)
        for _ in range(3):
            chi2.add_(torch.randn(x.shape, generator=gen, dtype=work).square_())
        z.div_(chi2.div_(3).sqrt_()).div_(math.sqrt(3.0))
        spikes = torch.rand(x.shape, generator=gen, dtype=work) < 1.0 / SPIKE_EVERY
        z.add_(spikes * z.sign() * SPIKE_SIZE)
        del chi2, spikes
        loc, scale = mean, std * _uniform(gen, 1.0, 3.0)  # the task's location, a wider spread
    else:
        loc, scale = mean + shift, std * factor
    if lo >= 0:  # non-negative stays non-negative (a heavy upper tail)
        return z.abs_().mul_(scale).add_(abs(loc))
    if hi <= 0:
        return z.abs_().mul_(-scale).sub_(abs(loc))
    return z.mul_(scale).add_(loc)


def judged_output(model: Any, inputs: list[Any], first: Any) -> tuple[Any, str]:
    """The task's `model` on a distribution trial's `inputs` (where they are), and why that
    trial cannot be judged ("" if it can): the model raised, or `usable` says no."""
    import torch

    from cuda_agent.evaluator.tensors import tensors

    try:
        with torch.no_grad():
            out = model(*inputs)
        if any(t.is_cuda for _, t in tensors(out)):
            torch.cuda.synchronize()
    except Exception as exc:
        return None, f"the reference raised {type(exc).__name__}: {str(exc)[:300]}"
    return out, usable(out, first)


def usable(output: Any, first: Any) -> str:
    """Why a distribution trial's reference `output` cannot be judged ("" if it can): it is
    not finite where the task's first trial's output (`first`) is."""
    from cuda_agent.evaluator.tensors import tensors

    first_finite = all(bool(t.isfinite().all()) for _, t in tensors(first) if t.is_floating_point() or t.is_complex())
    for path, t in tensors(output):
        if (t.is_floating_point() or t.is_complex()) and first_finite and not bool(t.isfinite().all()):
            return f"the reference's {path} is not finite on these inputs"
    return ""


def barely_varies(outputs: list[Any], atol: float, rtol: float) -> bool:
    """Whether every output is within the tolerance of the first: a constant would pass
    every one of these trials."""
    from cuda_agent.evaluator.compare import compare_outputs

    return len(outputs) > 1 and all(compare_outputs(outputs[0], o, atol, rtol) is None for o in outputs[1:])
