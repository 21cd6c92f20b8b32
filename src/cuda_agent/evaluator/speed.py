"""From timings to speedups, with the checks that keep them honest.

Inputs: the candidate process's measurements (candidate and eager, interleaved) and the
trusted baseline process's (eager and torch.compile, interleaved, possibly cached).

Speedups compare the candidate with the *trusted* baselines, rescaled by how fast the
device probe (`timing.probe_workload`, timed in the same rounds on both sides) ran
beside the candidate, but only ever downwards:

    scale = min(1, (1 + PROBE_BAND) * probe_beside_candidate / probe_beside_baselines)
    speedup_vs_eager   = eager_trusted   * scale / candidate
    speedup_vs_compile = compile_trusted * scale / candidate

If the device is faster now than when the baselines were measured, the baselines shrink
with it; if it looks slower beside the candidate (a slower device, or a candidate that
slows its neighbours), nothing is gained. The probe's own spread between processes
(`PROBE_BAND`) is not read as drift: the probe varies more between processes than the
candidate and torch.compile do, so scaling by that spread would move speedups by noise
alone. A drift beyond a bound re-measures the baselines (see `evaluate`). Without a probe
on both sides, eager beside the candidate stands in for it (a noisier stand-in: see
`baselines.drifted`).

Those times come from inside the candidate's process, which its extension controls. The
parent times its own batches of calls (`vouch`), against the same batches of eager and
torch.compile in the trusted baseline process, with the protocol's own cost taken off
both. The vouched time per call bounds the in-process device time from below (`_vouch`:
less a band for the spread of batch times, and on the GPU less an allowance for the host
time a call may take beyond its device time, sized by the baselines' own). An in-process
time under that floor does not count: the parent's own speedup does (its vouched times
of eager and torch.compile over the candidate's), and the record is flagged
`in-process-time-not-vouched`. A forged clock, a forged profile or work skipped only
while profiled therefore gains at most the band and the allowance; a call short enough
to be bound by its launch is bounded by the memory bandwidth check instead.

On CUDA, times are device time (profiler); the wall time beside it is the cross-check:
work done on the host, in another thread or outside the profiled region shows up as a gap
between wall and device time that the baselines do not have.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules

# Kernel names from PyTorch itself (ATen, c10), from vendor libraries, and memory traffic.
_TORCH = re.compile(r"\bat::|\bc10::|\bat_cuda_detail::|\btriton_|\bvectorized_elementwise_kernel|"
                    r"\bunrolled_elementwise_kernel|\belementwise_kernel")
_LIBRARY = re.compile(r"cublas|cudnn|cutlass|xmma|gemm|gemv|sgemm|hgemm|cusparse|cufft|nvjet|"
                      r"implicit_convolve|winograd|fft|splitKreduce", re.I)
_MEMORY = re.compile(r"^(Memcpy|Memset|memcpy|memset)")

WALL_GAP_FACTOR = 2.0  # candidate's host gap may be this many times the baselines' ...
WALL_GAP_SLACK_US = 50.0  # ... plus this
TORCH_SHARE_REJECT = 0.5  # share of device time in PyTorch's own kernels that rejects
TORCH_SHARE_FLAG = 0.1
PROBE_BAND = 0.05  # the probe beside the candidate may be this much faster before speedups shrink
BANDWIDTH_FACTOR = 1.5  # implied traffic above this many times the measured copy bandwidth rejects
# How the parent's vouched time per call (`vouch.per_call_work_us`) bounds the in-process
# device time from below:
#   floor = (vouched - host allowance) / (1 + VOUCH_BAND + batch spreads + drift / vouched)
# VOUCH_BAND: how far batch times move between processes (wider on a shared CPU).
VOUCH_BAND = {"cuda": 0.10, "cpu": 0.20}
# drift = PROTOCOL_DRIFT * the protocol's cost per call (the null subject's): how much that
# cost may differ between the baseline process (where it is measured, maybe long ago) and
# the candidate's; on a small task, where new inputs and a hash cost more than the call,
# it lowers the floor, never to zero.
PROTOCOL_DRIFT = {"cuda": 0.05, "cpu": 0.20}
# host allowance = factor * how far the baselines' vouched time per call exceeds their
# device time, + slack: a GPU call bound by its launch on the host takes more wall time
# than device time, which no wall clock outside the process can resolve; the bandwidth
# check bounds such calls instead. On the CPU the call's time is the device time.
HOST_ALLOWANCE = {"cuda": (2.0, 30.0), "cpu": (0.0, 0.0)}


def kernel_kind(name: str) -> str:
    if _MEMORY.search(name):
        return "memory"
    if _LIBRARY.search(name):
        return "library"
    if _TORCH.search(name):
        return "torch"
    return "extension"


@dataclass
class SpeedOutcome:
    times_us: dict[str, dict[str, float]]
    wall_times_us: dict[str, dict[str, float]]
    speedup_vs_eager: float
    speedup_vs_compile: float
    wall_speedup_vs_eager: float
    wall_speedup_vs_compile: float
    flags: list[str] = field(default_factory=list)
    rejected: tuple[str, str] | None = None  # (rule, message)
    details: dict[str, Any] = field(default_factory=dict)


def _short(stats: dict[str, Any]) -> dict[str, float]:
    keys = ("median_us", "min_us", "max_us", "mean_us", "iterations", "rel_ci", "spread")
    return {k: (round(float(stats[k]), 4) if k != "iterations" else int(stats[k])) for k in keys if k in stats}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else math.inf if a > 0 else 0.0


def _vouch(out: SpeedOutcome, cand: dict[str, Any] | None, base: dict[str, Any] | None,
           baseline_us: tuple[float, float], c_dev: float, wscale: float, device: str) -> None:
    """Hold the in-process device time to the parent's vouched batches (see the module text).

    `baseline_us`: the trusted eager and torch.compile device times per call; `c_dev`
    the candidate's in-process one; `wscale` the baselines' rescaling of wall times."""
    from cuda_agent.evaluator.vouch import per_call_work_us

    if not cand or not base or "eager" not in base:
        out.flags.append(R.FLAG_UNVOUCHED)
        out.details["vouched"] = "no vouched times to check the in-process ones against"
        return
    null = base.get("null")
    compile_ = base.get("compile") or base["eager"]
    (c, uc), (e, _), (k, _) = (per_call_work_us(x, null) for x in (cand, base["eager"], compile_))
    b_e, b_k = baseline_us
    factor, slack_us = HOST_ALLOWANCE.get(device, (0.0, 0.0))
    host = factor * max(e - b_e, k - b_k, 0.0) + slack_us if factor else 0.0
    drift = PROTOCOL_DRIFT.get(device, 0.2) * (float(null["min_us"]) if null else 0.0)
    floor = max(c - host, 0.0) / (1 + VOUCH_BAND.get(device, 0.2) + uc + drift / c) if c > 0 else 0.0
    v_e, v_k = round(_ratio(e * wscale, c), 4), round(_ratio(k * wscale, c), 4)
    out.details["vouched"] = {
        "per_call_us": {"candidate": cand.get("per_call_us"), "eager": base["eager"].get("per_call_us"),
                        "compile": compile_.get("per_call_us"), "protocol": null.get("per_call_us") if null else None},
        "work_us": {"candidate": round(c, 3), "eager": round(e, 3), "compile": round(k, 3)},
        "calls_per_batch": cand.get("calls"), "host_allowance_us": round(host, 3),
        "floor_us": round(floor, 3), "in_process_us": round(c_dev, 3),
        "speedup_vs_eager": v_e, "speedup_vs_compile": v_k,
        "in_process": {"speedup_vs_eager": out.speedup_vs_eager, "speedup_vs_compile": out.speedup_vs_compile}}
    if c_dev < floor:  # refuted: the parent's own figures count (never more than the claim)
        out.flags.append(R.FLAG_UNVOUCHED)
        out.speedup_vs_eager = min(out.speedup_vs_eager, v_e)
        out.speedup_vs_compile = min(out.speedup_vs_compile, v_k)


def judge(candidate: dict[str, Any], eager_now: dict[str, Any], base_eager: dict[str, Any],
          base_compile: dict[str, Any], device: str, target_rel_ci: float = 0.01,
          drift_bound: float = 0.10, io_bytes: int = 0, bandwidth_gbps: float = 0.0,
          probe_now: dict[str, Any] | None = None, probe_base: dict[str, Any] | None = None,
          vouched: dict[str, Any] | None = None, vouched_base: dict[str, Any] | None = None) -> SpeedOutcome:
    """Speedups and checks; the dicts are `timing.Measurement.summary()` outputs.

    `io_bytes` (inputs plus outputs of one call) and `bandwidth_gbps` (the device's measured
    copy traffic) bound how fast a call can be: with the L2 cache flushed, inputs come from
    device memory."""
    c_dev, e_dev = candidate["device"]["median_us"], eager_now["device"]["median_us"]
    b_e_dev, b_c_dev = base_eager["device"]["median_us"], base_compile["device"]["median_us"]
    c_wall, e_wall = candidate["wall"]["median_us"], eager_now["wall"]["median_us"]
    b_e_wall, b_c_wall = base_eager["wall"]["median_us"], base_compile["wall"]["median_us"]
    if probe_now and probe_base and probe_base["device"]["median_us"] > 0 and probe_base["wall"]["median_us"] > 0:
        scale = min(1.0, (1 + PROBE_BAND) * _ratio(probe_now["device"]["median_us"], probe_base["device"]["median_us"]))
        wscale = min(1.0, (1 + PROBE_BAND) * _ratio(probe_now["wall"]["median_us"], probe_base["wall"]["median_us"]))
        scaled_by = "probe"
    else:
        scale = min(1.0, _ratio(e_dev, b_e_dev)) if b_e_dev > 0 else 1.0
        wscale = min(1.0, _ratio(e_wall, b_e_wall)) if b_e_wall > 0 else 1.0
        scaled_by = "eager"
    out = SpeedOutcome(
        times_us={"candidate": _short(candidate["device"]), "eager": _short(base_eager["device"]),
                  "compile": _short(base_compile["device"]), "eager_beside_candidate": _short(eager_now["device"])},
        wall_times_us={"candidate": _short(candidate["wall"]), "eager": _short(base_eager["wall"]),
                       "compile": _short(base_compile["wall"]), "eager_beside_candidate": _short(eager_now["wall"])},
        speedup_vs_eager=round(_ratio(b_e_dev * scale, c_dev), 4),
        speedup_vs_compile=round(_ratio(b_c_dev * scale, c_dev), 4),
        wall_speedup_vs_eager=round(_ratio(b_e_wall * wscale, c_wall), 4),
        wall_speedup_vs_compile=round(_ratio(b_c_wall * wscale, c_wall), 4),
    )
    out.details["scale"] = round(scale, 4)
    out.details["scaled_by"] = scaled_by
    if probe_now and probe_base:
        out.details["probe_us"] = {"beside_candidate": _short(probe_now["device"]),
                                   "beside_baselines": _short(probe_base["device"])}
    _vouch(out, vouched, vouched_base, (b_e_dev, b_c_dev), c_dev, wscale, device)
    if b_e_dev > 0 and e_dev > b_e_dev * (1 + drift_bound):
        out.flags.append(R.FLAG_EAGER_SLOWER)
    if max(candidate["device"].get("rel_ci", 0), base_compile["device"].get("rel_ci", 0)) > target_rel_ci:
        out.flags.append(R.FLAG_WIDE_CI)
    if out.speedup_vs_compile > 10 or out.speedup_vs_eager > 10:
        out.flags.append(R.FLAG_OVER_10X)
    if device != "cuda":
        return out

    if c_dev <= 0:
        out.rejected = (rules.NO_DEVICE_WORK, f"no GPU work was seen during the timed calls (wall time "
                        f"{c_wall:.1f} us); the computation must run in your CUDA kernels.")
        return out
    own, theirs = set(candidate.get("streams") or []), set(eager_now.get("streams") or [])
    if len(theirs) == 1 and own - theirs:
        out.rejected = (rules.STREAM, f"during the timed calls GPU work ran on stream(s) "
                        f"{sorted(own - theirs)}, not on the current stream {sorted(theirs)[0]}; launch all work "
                        "on c10::cuda::getCurrentCUDAStream() so callers can wait for it.")
        return out
    if io_bytes > 0 and bandwidth_gbps > 0:
        implied = io_bytes / (c_dev * 1e-6) / 1e9
        out.details["implied_gbps"] = round(implied, 1)
        if implied > BANDWIDTH_FACTOR * bandwidth_gbps:
            baseline_gbps = io_bytes / (min(b_e_dev, b_c_dev) * 1e-6) / 1e9 if min(b_e_dev, b_c_dev) > 0 else 0.0
            if baseline_gbps > bandwidth_gbps:
                out.flags.append(R.FLAG_OVER_BANDWIDTH)  # the baselines read less than all inputs, too
            else:
                out.rejected = (rules.BANDWIDTH, f"{io_bytes / 1e6:.2f} MB of inputs and outputs in {c_dev:.2f} us "
                                f"is {implied:.0f} GB/s, more than the device's memory can move "
                                f"({bandwidth_gbps:.0f} GB/s measured); the timed calls cannot have done the work.")
                return out
    gap = c_wall - c_dev
    ref_gap = max(e_wall - e_dev, b_e_wall - b_e_dev, b_c_wall - b_c_dev, 0.0)
    out.details["host_gap_us"] = {"candidate": round(gap, 2), "baselines": round(ref_gap, 2)}
    if gap > WALL_GAP_FACTOR * ref_gap + WALL_GAP_SLACK_US and c_wall > 1.5 * c_dev:
        out.rejected = (rules.WALL_GAP, f"each call takes {c_wall:.1f} us of wall time but only {c_dev:.1f} us "
                        f"of GPU time; the baselines' gap is {ref_gap:.1f} us. Work done on the host, in "
                        "another thread or outside the profiled stream does not count: do it in your kernels.")
        return out
    kinds: dict[str, float] = {}
    for name, k in (candidate.get("kernels") or {}).items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + float(k.get("us", 0.0))
    total = sum(kinds.values())
    out.details["device_time_by_kind"] = {k: round(v / total, 4) for k, v in kinds.items()} if total else {}
    torch_share = kinds.get("torch", 0.0) / total if total else 0.0
    if torch_share > TORCH_SHARE_REJECT:
        top = [n for n, _ in sorted((candidate.get("kernels") or {}).items(), key=lambda kv: -kv[1].get("us", 0))
               if kernel_kind(n) == "torch"][:3]
        out.rejected = (rules.FOREIGN_KERNELS, f"{torch_share:.0%} of the candidate's GPU time is spent in "
                        f"PyTorch's own kernels ({'; '.join(x[:70] for x in top)}), not in the extension's.")
    elif torch_share > TORCH_SHARE_FLAG:
        out.flags.append(R.FLAG_TORCH_KERNELS)
    return out
