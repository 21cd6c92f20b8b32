"""The shared timing protocol on the CPU: ordering, input rotation, patch-proof clocks."""

from __future__ import annotations

import time

import torch

from cuda_agent.evaluator import timing


def test_fast_and_slow_subjects_are_ordered_and_interleaved() -> None:
    x = [torch.randn(256, 256), torch.randn(256, 256)]
    sets = [x, [torch.randn(256, 256), torch.randn(256, 256)]]

    def fast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def slow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            a = a @ b
        return a

    res = timing.measure({"fast": fast, "slow": slow}, sets, "cpu",
                         timing.Protocol(warmup=2, min_iters=10, max_iters=60, budget_s=10))
    f, s = res["fast"].summary()["device"], res["slow"].summary()["device"]
    assert f["iterations"] == s["iterations"] >= 10  # interleaved: same number of rounds
    assert s["median_us"] > 5 * f["median_us"]
    assert f["min_us"] <= f["median_us"] <= f["max_us"]


def test_inputs_are_refreshed_before_every_timed_call() -> None:
    seen: list[float] = []

    def spy(a: torch.Tensor) -> torch.Tensor:
        seen.append(float(a[0]))
        return a

    sets = [[torch.full((4,), float(i))] for i in range(3)]
    timing.measure({"spy": spy}, sets, "cpu", timing.Protocol(warmup=0, min_iters=6, max_iters=6))
    assert seen == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_subjects_of_one_round_see_different_inputs() -> None:
    seen: dict[str, list[float]] = {"a": [], "b": []}
    sets = [[torch.full((4,), float(i))] for i in range(3)]
    timing.measure({n: (lambda x, n=n: seen[n].append(float(x[0]))) for n in seen}, sets, "cpu",
                   timing.Protocol(warmup=0, min_iters=4, max_iters=4))
    assert all(x != y for x, y in zip(seen["a"], seen["b"], strict=True))


def test_patching_the_clock_after_import_changes_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: 0)
    res = timing.measure({"sleep": lambda a: time.sleep(0.002)}, [[torch.zeros(1)]], "cpu",
                         timing.Protocol(warmup=0, min_iters=5, max_iters=5))
    assert res["sleep"].summary()["wall"]["median_us"] > 1500


def test_median_confidence_interval() -> None:
    assert timing.median_rel_ci([1.0] * 50) == 0.0
    assert timing.median_rel_ci([1.0, 2.0]) == float("inf")
    wide = timing.median_rel_ci([float(i) for i in range(1, 101)])
    assert 0.1 < wide < 0.3
