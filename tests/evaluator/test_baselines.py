"""Baseline cache: hits, misses on any key change, corrupt files, drift."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cuda_agent.evaluator import baselines as BL


def _stats(median: float) -> dict[str, object]:
    s = {"median_us": median, "min_us": median * 0.9, "max_us": median * 1.1, "iterations": 20}
    return {"device": s, "wall": s, "kernels": {}}


def test_hit_and_invalidation(tmp_path: Path) -> None:
    key = BL.BaselineKey("abc", "NVIDIA H200", "2.11.0", 1)
    assert BL.load(key, tmp_path) is None
    BL.store(key, _stats(100.0), _stats(80.0), tmp_path)
    hit = BL.load(key, tmp_path)
    assert hit is not None and hit.eager_median == 100.0 and hit.compile_median == 80.0
    for other in (
        BL.BaselineKey("abd", "NVIDIA H200", "2.11.0", 1),
        BL.BaselineKey("abc", "NVIDIA H100", "2.11.0", 1),
        BL.BaselineKey("abc", "NVIDIA H200", "2.12.0", 1),
        BL.BaselineKey("abc", "NVIDIA H200", "2.11.0", 2),
        BL.BaselineKey("abc", "NVIDIA H200", "2.11.0", 1, compile_mode="max-autotune"),
    ):
        assert BL.load(other, tmp_path) is None


def test_corrupt_cache_file_is_a_miss(tmp_path: Path) -> None:
    key = BL.BaselineKey("abc", "cpu", "2.13.0", 1, threads=2)
    BL.store(key, _stats(10.0), _stats(9.0), tmp_path)
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")
    assert BL.load(key, tmp_path) is None
    BL.store(key, {"wall": {}}, _stats(9.0), tmp_path)  # an entry without device time
    assert BL.load(key, tmp_path) is None


def test_drift() -> None:
    base = BL.Baseline(eager=_stats(100.0), compile=_stats(80.0), measured_at=0.0)
    assert not BL.drifted(base, 105.0)
    assert BL.drifted(base, 115.0)
    assert BL.drifted(base, 85.0)


def test_drift_is_judged_by_the_device_probe_when_both_sides_have_one() -> None:
    base = BL.Baseline(eager=_stats(100.0), compile=_stats(80.0), measured_at=0.0, extra={"probe": _stats(50.0)})
    assert base.probe_median == 50.0
    # eager 30% off is the noise of a small task, not a changed device: the probe agrees
    assert not BL.drifted(base, 70.0, 50.5, bound=0.05)
    assert not BL.drifted(base, 135.0, 49.0, bound=0.05)
    # the probe itself moved: the device is not what it was
    assert BL.drifted(base, 100.0, 54.0, bound=0.05)
    assert BL.drifted(base, 100.0, 46.0, bound=0.05)
    # eager far beyond any noise: a stale entry, whatever the probe says
    assert BL.drifted(base, 100.0 * (1 + BL.EAGER_STALE_BOUND) + 1, 50.0, bound=0.05)
    # no probe beside the candidate (or none cached): eager against the bound, as before
    assert BL.drifted(base, 115.0, None, bound=0.10)
    unprobed = BL.Baseline(eager=_stats(100.0), compile=_stats(80.0), measured_at=0.0)
    assert unprobed.probe_median is None and BL.drifted(unprobed, 115.0, 50.0, bound=0.10)


def test_gpu_name_is_asked_once_and_a_failed_query_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key's GPU name comes from nvidia-smi (no CUDA context in the evaluator),
    once per process and GPU; an nvidia-smi that fails is asked again next time. Here a
    stand-in nvidia-smi on PATH answers, counting its calls, and fails for GPU 9."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$*" >> ' + str(calls) + '\n'
                    'case "$*" in *"-i 9"*) exit 6;; esac\necho "NVIDIA Stand-in GPU"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(BL, "_gpu_names", {})
    assert BL.device_name("cuda", 3) == "NVIDIA Stand-in GPU"
    assert BL.device_name("cuda", 3) == "NVIDIA Stand-in GPU"
    assert len(calls.read_text().splitlines()) == 1
    assert BL.device_name("cuda", 9) == "cuda" and BL.device_name("cuda", 9) == "cuda"
    assert len(calls.read_text().splitlines()) == 3  # the failed query was asked again
    assert BL.device_name("cpu").startswith("cpu:")
