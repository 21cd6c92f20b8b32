"""Rewards from a verdict and its speedups.

`milestone` is the published reward: -1 if compilation or correctness fails; 3 if more
than `threshold` faster than both eager and torch.compile; 2 if faster than eager only;
1 otherwise. "More than 5% faster than t0" means (t0 - t) / t0 > 0.05.
`speedup` is the paper's ablation: t_compile / t for a correct solution, -1 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.05


@dataclass(frozen=True)
class Speeds:
    candidate_s: float
    eager_s: float
    compile_s: float


def faster(t: float, t0: float, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """True when t is more than `threshold` (a fraction) faster than t0."""
    return t0 > 0 and (t0 - t) / t0 > threshold


def milestone(correct: bool, speeds: Speeds | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    if not correct:
        return -1.0
    if speeds is None:
        return 1.0
    beats_eager = faster(speeds.candidate_s, speeds.eager_s, threshold)
    beats_compile = faster(speeds.candidate_s, speeds.compile_s, threshold)
    if beats_eager and beats_compile:
        return 3.0
    if beats_eager:
        return 2.0
    return 1.0


def speedup(correct: bool, speeds: Speeds | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    if not correct:
        return -1.0
    if speeds is None or speeds.candidate_s <= 0:
        return 1.0
    return speeds.compile_s / speeds.candidate_s


REWARDS: dict[str, Callable[[bool, Speeds | None, float], float]] = {
    "milestone": milestone,
    "speedup": speedup,
}


def reward(name: str, correct: bool, speeds: Speeds | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    try:
        fn = REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {', '.join(REWARDS)}") from None
    return fn(correct, speeds, threshold)
