"""From measurements to speedups: rescaling, flags and the CUDA cross-checks of `speed.judge`."""

from __future__ import annotations

from typing import Any

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules, speed


def summary(device_us: float, wall_us: float | None = None, *, rel_ci: float = 0.001,
            kernels: dict[str, float] | None = None, streams: tuple[int, ...] = (7,)) -> dict[str, Any]:
    def stats(x: float) -> dict[str, float]:
        return {"median_us": x, "min_us": x, "max_us": x, "mean_us": x, "iterations": 50, "rel_ci": rel_ci,
                "spread": 0.0}

    return {"device": stats(device_us), "wall": stats(wall_us if wall_us is not None else device_us + 10),
            "kernels": {k: {"calls": 50, "us": v} for k, v in (kernels or {"my_kernel": device_us * 50}).items()},
            "streams": list(streams)}


EAGER = summary(100.0, kernels={"at::native::vectorized_elementwise_kernel<...>": 5000})
COMPILE = summary(80.0, kernels={"triton_poi_fused_add_mul_0": 4000})


def test_speedups_use_the_trusted_baselines_rescaled_only_downwards() -> None:
    out = speed.judge(summary(50.0), EAGER, EAGER, COMPILE, "cuda")
    assert out.rejected is None and out.speedup_vs_eager == 2.0 and out.speedup_vs_compile == 1.6
    faster_now = speed.judge(summary(50.0), summary(90.0), EAGER, COMPILE, "cuda")  # the device got faster
    assert faster_now.speedup_vs_eager == 1.8 and faster_now.details["scale"] == 0.9
    slower_now = speed.judge(summary(50.0), summary(150.0), EAGER, COMPILE, "cuda")  # nothing gained
    assert slower_now.speedup_vs_eager == 2.0 and R.FLAG_EAGER_SLOWER in slower_now.flags


def test_the_device_probe_sets_the_scale_not_eager_noise() -> None:
    probe = summary(60.0)
    # eager beside the candidate ran 30% faster (process-to-process noise of a small task),
    # the probe did not move: the trusted baselines stand as they are
    out = speed.judge(summary(50.0), summary(70.0), EAGER, COMPILE, "cuda", probe_now=probe, probe_base=probe)
    assert out.speedup_vs_eager == 2.0 and out.speedup_vs_compile == 1.6
    assert out.details["scale"] == 1.0 and out.details["scaled_by"] == "probe"
    # the probe ran 10% faster beside the candidate: the device is faster now, baselines
    # shrink by what lies beyond the probe's own spread between processes
    faster = speed.judge(summary(50.0), EAGER, EAGER, COMPILE, "cuda", probe_now=summary(54.0), probe_base=probe)
    assert faster.details["scale"] == round(0.9 * (1 + speed.PROBE_BAND), 4) == 0.945
    assert faster.speedup_vs_compile == round(80 * 0.945 / 50, 4)
    # 4% faster: inside that spread, read as the probe's noise, not as drift
    noise = speed.judge(summary(50.0), EAGER, EAGER, COMPILE, "cuda", probe_now=summary(57.6), probe_base=probe)
    assert noise.details["scale"] == 1.0 and noise.speedup_vs_compile == 1.6
    # a slower probe gains the candidate nothing
    slower = speed.judge(summary(50.0), EAGER, EAGER, COMPILE, "cuda", probe_now=summary(90.0), probe_base=probe)
    assert slower.details["scale"] == 1.0 and slower.speedup_vs_compile == 1.6
    assert faster.details["probe_us"]["beside_candidate"]["median_us"] == 54.0


def test_flags_for_wide_intervals_and_implausible_speedups() -> None:
    out = speed.judge(summary(5.0, rel_ci=0.05), EAGER, EAGER, COMPILE, "cpu")
    assert R.FLAG_WIDE_CI in out.flags and R.FLAG_OVER_10X in out.flags and out.rejected is None


def test_host_work_shows_as_a_wall_time_gap() -> None:
    out = speed.judge(summary(20.0, wall_us=900.0), EAGER, EAGER, COMPILE, "cuda")
    assert out.rejected and out.rejected[0] == rules.WALL_GAP
    assert speed.judge(summary(20.0, wall_us=900.0), EAGER, EAGER, COMPILE, "cpu").rejected is None


def test_no_gpu_work_and_work_on_another_stream_are_rejected() -> None:
    assert speed.judge(summary(0.0, wall_us=30.0), EAGER, EAGER, COMPILE, "cuda").rejected[0] == rules.NO_DEVICE_WORK
    out = speed.judge(summary(50.0, streams=(7, 13)), EAGER, EAGER, COMPILE, "cuda")
    assert out.rejected and out.rejected[0] == rules.STREAM and "13" in out.rejected[1]


def test_time_in_pytorch_kernels_is_rejected_or_flagged() -> None:
    mostly_torch = summary(50.0, kernels={"at::native::reduce_kernel<...>": 2000, "my_kernel": 500})
    assert speed.judge(mostly_torch, EAGER, EAGER, COMPILE, "cuda").rejected[0] == rules.FOREIGN_KERNELS
    some_torch = summary(50.0, kernels={"at::native::reduce_kernel<...>": 400, "my_kernel": 2100, "sgemm_128x64": 10})
    out = speed.judge(some_torch, EAGER, EAGER, COMPILE, "cuda")
    assert out.rejected is None and R.FLAG_TORCH_KERNELS in out.flags
    assert set(out.details["device_time_by_kind"]) == {"torch", "extension", "library"}


def test_faster_than_memory_bandwidth_is_rejected() -> None:
    mb = 400_000_000  # 400 MB in and out: 100 us at 4000 GB/s
    ok = speed.judge(summary(120.0), summary(400.0), summary(400.0), summary(130.0), "cuda",
                     io_bytes=mb, bandwidth_gbps=4000.0)
    assert ok.rejected is None and 3000 < ok.details["implied_gbps"] < 3500
    out = speed.judge(summary(40.0), summary(400.0), summary(400.0), summary(130.0), "cuda",
                      io_bytes=mb, bandwidth_gbps=4000.0)
    assert out.rejected and out.rejected[0] == rules.BANDWIDTH and "GB/s" in out.rejected[1]
    # When the baselines are "too fast" as well, the task reads less than all of its inputs: flag only.
    both = speed.judge(summary(40.0), summary(60.0), summary(60.0), summary(50.0), "cuda",
                       io_bytes=mb, bandwidth_gbps=4000.0)
    assert both.rejected is None and R.FLAG_OVER_BANDWIDTH in both.flags


def batches(per_call_us: float, spread: float = 0.0) -> dict[str, Any]:
    """`vouch.summary` of five batches, the fastest at `per_call_us`."""
    return {"median_us": per_call_us * (1 + spread), "min_us": per_call_us, "max_us": per_call_us * (1 + 2 * spread),
            "batches": 5, "calls": 100, "per_call_us": [per_call_us] * 5}


def vouched_judge(c_dev: float, c_batch: float, e_dev: float, e_batch: float, device: str = "cuda",
                  null: float = 400.0) -> speed.SpeedOutcome:
    base = {"null": batches(null), "eager": batches(null + e_batch), "compile": batches(null + e_batch)}
    eager = summary(e_dev, kernels={"at::native::vectorized_elementwise_kernel<...>": e_dev * 50})
    return speed.judge(summary(c_dev), eager, eager, eager, device, vouched=batches(null + c_batch),
                       vouched_base=base)


def test_the_parents_batches_bound_the_in_process_device_time() -> None:
    # A launch-bound GPU call (the axpby of the GPU suite on an H100): 10 us of device
    # time in 40 us of host time per call, eager 25 us in 60. The parent's wall clock
    # cannot see the difference; the in-process time stands.
    honest = vouched_judge(10.0, 40.0, 25.0, 60.0)
    assert R.FLAG_UNVOUCHED not in honest.flags and honest.speedup_vs_eager == 2.5, honest.details["vouched"]
    # A call whose batches take 1000 us claims 10: the floor counts, not the claim.
    forged = vouched_judge(10.0, 1000.0, 1100.0, 1100.0)
    v = forged.details["vouched"]
    assert R.FLAG_UNVOUCHED in forged.flags and v["in_process"]["speedup_vs_eager"] == 110.0, v
    assert 800 < v["floor_us"] < 1000 and forged.speedup_vs_eager == v["speedup_vs_eager"] < 1.4, v
    # The same call, honestly timed: within the band.
    assert R.FLAG_UNVOUCHED not in vouched_judge(950.0, 1000.0, 1100.0, 1100.0).flags
    # On the CPU there is no host allowance: even where the protocol (2000 us) costs far
    # more than the call (300 us), a call claiming next to nothing is held to the floor.
    cpu = vouched_judge(3.0, 300.0, 400.0, 400.0, device="cpu", null=2000.0)
    assert R.FLAG_UNVOUCHED in cpu.flags and 0 < cpu.details["vouched"]["floor_us"] < 300, cpu.details["vouched"]
    assert cpu.speedup_vs_eager < 10 and R.FLAG_UNVOUCHED not in vouched_judge(250.0, 300.0, 400.0, 400.0, "cpu",
                                                                               2000.0).flags
    # Without the parent's batches nothing is vouched for.
    none = speed.judge(summary(10.0), EAGER, EAGER, COMPILE, "cuda")
    assert R.FLAG_UNVOUCHED in none.flags
