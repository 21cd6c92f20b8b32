"""The benchmark's jobs and their configuration: what every pool runs, one task at a time.

A job is a task with its solution (or none). A slot is what one worker owns: one GPU
(evaluations never share a GPU, so timings are never disturbed by a neighbour) or, on the
CPU backend, a share of the cores. `evaluate_job` scores one job on one slot, evaluating
the solution or running an agent episode, and never raises: a failure is a record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cuda_agent.bench.records import MISSING, BenchRecord
from cuda_agent.bench.suite import Entry
from cuda_agent.machine import usable_cores

Job = tuple[Entry, Path | None]
OnRecord = Callable[[BenchRecord], None]


@dataclass
class AgentSpec:
    """What `--agent` runs per task (see `cuda-agent optimize`)."""

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    replay: str | None = None  # a script or trajectory played back instead of a model
    max_turns: int = 200
    context_tokens: int = 131_072
    wall_time_s: float = 4 * 3600.0
    temperature: float | None = None
    score_every_build: bool = False
    episodes_per_device: int = 1  # concurrent episodes sharing one device (evaluations take turns)


@dataclass
class BenchConfig:
    device: str = "cpu"
    gpus: list[int] = field(default_factory=lambda: [0])  # CUDA: one worker per GPU index
    workers: int = 1  # CPU backend: workers sharing the cores
    # the evaluation service's build threads, ahead of the GPUs; 0: half the cores (CUDA),
    # on the CPU backend builds run inside the worker
    build_workers: int = 0
    # builds ahead of the workers; None: on CUDA only (CPU builds would disturb CPU timing)
    overlap_builds: bool | None = None
    eval_options: dict[str, Any] = field(default_factory=dict)  # passed to EvalOptions
    agent: AgentSpec | None = None
    ray_address: str | None = None
    service_url: str | None = None  # a running `cuda-agent serve` (default: one started for the run)


@dataclass
class Slot:
    name: str
    gpu: int | None
    threads: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)


def slots_for(cfg: BenchConfig) -> list[Slot]:
    if cfg.device == "cuda":
        return [Slot(f"gpu{g}", g, None) for g in cfg.gpus]
    n = max(1, cfg.workers)
    per = max(1, usable_cores() // n)
    return [Slot(f"cpu{i}", None, per) for i in range(n)]


def eval_options(cfg: BenchConfig, slot: Slot) -> Any:
    from cuda_agent.evaluator.evaluate import EvalOptions

    # A worker evaluates one solution after another: each takes the spare processes the
    # one before left (see evaluator.warm).
    opts = EvalOptions(device=cfg.device, **{"warm": True, **cfg.eval_options})
    if slot.gpu is not None:
        opts = replace(opts, gpu_index=slot.gpu)
    if slot.threads is not None and opts.threads is None:
        opts = replace(opts, threads=slot.threads)
    return opts


def _seconds_since(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


def evaluate_job(entry: Entry, solution: Path | None, cfg: BenchConfig, slot: Slot,
                 out: Path) -> BenchRecord:
    """One task on one slot; never raises (a failure is a record)."""
    from cuda_agent.evaluator.evaluate import evaluate
    from cuda_agent.evaluator.solution import SolutionError, load_solution

    t0 = time.perf_counter()
    base = {"worker": slot.name, "gpu": slot.gpu}
    if cfg.agent is not None:
        return _agent_job(entry, cfg, slot, out, t0)
    if solution is None:
        return BenchRecord.for_entry(
            entry, MISSING, message="no solution for this task in the solutions folder", **base)
    try:
        res = evaluate(entry.task, load_solution(solution), eval_options(cfg, slot))
    except SolutionError as exc:
        return BenchRecord.for_entry(entry, "rejected", message=str(exc), solution=str(solution),
                                     seconds=_seconds_since(t0), **base)
    except Exception as exc:  # the evaluator itself failed: keep going, say so
        return BenchRecord.error(entry, exc, solution=str(solution), seconds=_seconds_since(t0),
                                 **base)
    return BenchRecord.from_eval(entry, res, solution=str(solution), seconds=_seconds_since(t0),
                                 **base)


def _agent_job(entry: Entry, cfg: BenchConfig, slot: Slot, out: Path, t0: float) -> BenchRecord:
    import asyncio

    from cuda_agent.agent import AgentConfig, make_client, run_episode

    spec = cfg.agent
    assert spec is not None
    ep_dir = out / "episodes" / entry.level / entry.task.name.replace("/", "_")
    base = {"worker": slot.name, "gpu": slot.gpu, "trajectory": str(ep_dir / "trajectory.jsonl")}
    try:
        client = make_client(spec.model or "", spec.base_url, spec.api_key, replay=spec.replay,
                             temperature=spec.temperature)
        acfg = AgentConfig(max_turns=spec.max_turns, context_tokens=spec.context_tokens,
                           wall_time_s=spec.wall_time_s, score_every_build=spec.score_every_build,
                           sandbox=cfg.eval_options.get("sandbox", True), gpu_index=slot.gpu)
        resume = (ep_dir / "trajectory.jsonl").exists()
        s = asyncio.run(run_episode(entry.task, client, ep_dir, device=cfg.device, config=acfg,
                                    resume=resume, eval_lock=slot.lock))
    except Exception as exc:
        return BenchRecord.error(entry, exc, seconds=_seconds_since(t0), **base)
    final = s.final or {}
    return BenchRecord.for_entry(
        entry, "ok" if s.correct else str(final.get("status") or "failed"), correct=s.correct,
        reward=s.reward, speedup_vs_eager=s.speedup_vs_eager,
        speedup_vs_compile=s.speedup_vs_compile, flags=list(final.get("flags") or []),
        rule=final.get("rule"),
        message=f"{s.reason} after {s.turns} turns; best from {s.best_from}",
        solution=str(ep_dir / "best") if s.correct else None, seconds=_seconds_since(t0), **base)

