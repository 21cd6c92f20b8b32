"""The milestone reward of DESIGN.md and the raw-speedup ablation, at their boundaries."""

from __future__ import annotations

import pytest

from cuda_agent.evaluator.reward import Speedups, faster, reward


def Speeds(candidate: float, eager: float, compile: float) -> Speedups:  # noqa: N802
    """Speedups from times, as the cases below are written."""
    return Speedups(vs_eager=eager / candidate, vs_compile=compile / candidate)


def test_faster_is_strictly_more_than_the_threshold() -> None:
    assert faster(0.94, 1.0)
    assert not faster(0.951, 1.0)
    assert not faster(1.2, 1.0)
    assert faster(0.5, 1.0, threshold=0.4) and not faster(0.6, 1.0, threshold=0.4)


@pytest.mark.parametrize(
    "correct, speeds, expected",
    [
        (False, Speeds(0.1, 1.0, 1.0), -1.0),  # fastest, but wrong
        (True, None, 1.0),  # correct, not timed
        (True, Speeds(1.0, 1.0, 1.0), 1.0),  # correct but not faster
        (True, Speeds(0.97, 1.0, 1.0), 1.0),  # 3% faster is not enough
        (True, Speeds(0.9, 1.0, 0.8), 2.0),  # faster than eager only
        (True, Speeds(0.7, 1.0, 0.8), 3.0),  # faster than both
        (True, Speeds(0.7, 0.72, 0.8), 1.0),  # faster than compile but not eager: still 1
    ],
)
def test_milestone(correct: bool, speeds: Speedups | None, expected: float) -> None:
    assert reward("milestone", correct, speeds) == expected


def test_speedup_reward() -> None:
    assert reward("speedup", True, Speeds(0.5, 1.0, 2.0)) == pytest.approx(4.0)
    assert reward("speedup", False, Speeds(0.5, 1.0, 2.0)) == -1.0


def test_unknown_reward_name() -> None:
    with pytest.raises(ValueError, match="milestone"):
        reward("nope", True, None)
