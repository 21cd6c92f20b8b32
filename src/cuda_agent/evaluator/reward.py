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
class Speedups:
    """A correct solution's speedups: baseline time / candidate time."""

    vs_eager: float
    vs_compile: float


def faster(t: float, t0: float, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """True when t is more than `threshold` (a fraction) faster than t0."""
    return t0 > 0 and (t0 - t) / t0 > threshold


def milestone(correct: bool, speedups: Speedups | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    if not correct:
        return -1.0
    if speedups is None:
        return 1.0
    # in units of the candidate's time: the candidate takes 1, a baseline its speedup
    beats_eager = faster(1.0, speedups.vs_eager, threshold)
    beats_compile = faster(1.0, speedups.vs_compile, threshold)
    if beats_eager and beats_compile:
        return 3.0
    if beats_eager:
        return 2.0
    return 1.0


def speedup(correct: bool, speedups: Speedups | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    if not correct:
        return -1.0
    if speedups is None:
        return 1.0
    return speedups.vs_compile


REWARDS: dict[str, Callable[[bool, Speedups | None, float], float]] = {
    "milestone": milestone,
    "speedup": speedup,
}


def reward(name: str, correct: bool, speedups: Speedups | None, threshold: float = DEFAULT_THRESHOLD) -> float:
    try:
        fn = REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {', '.join(REWARDS)}") from None
    return fn(correct, speedups, threshold)


def rescore(record: dict, name: str, threshold: float = DEFAULT_THRESHOLD) -> float:
    """A result record's reward under reward `name` (its verdict and speedups, another
    reward); a record with no verdict (None, empty) is -1."""
    if not record:
        return -1.0
    correct = bool(record.get("correct"))
    e, c = record.get("speedup_vs_eager"), record.get("speedup_vs_compile")
    if correct and record.get("reward_name", "milestone") == name and record.get("reward") is not None:
        return float(record["reward"])
    return reward(name, correct, Speedups(e, c) if e and c else None, threshold)
