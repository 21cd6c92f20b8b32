"""Run a suite: evaluate existing solutions, or run the agent per task, on a pool of workers.

Each worker owns one device slot: one GPU (evaluations never share a GPU, so timings are
never disturbed by a neighbour) or, on the CPU backend, a share of the cores. On CUDA the
builds (CPU work) run ahead on a separate build pool, into the content-hash build cache,
so a worker's GPU is busy timing one solution while the next ones compile. One record per
task is appended to `results.jsonl` as it completes; `resume` skips finished tasks.

The local pool (threads that drive sandboxed evaluator processes) is the default; `Ray`
(`ray_address`) runs the same jobs on actors holding one GPU each, for many GPUs or nodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cuda_agent.bench.records import ERROR, MISSING, BenchRecord, ResultsFile, from_eval, latest
from cuda_agent.bench.suite import Entry, find_solution
from cuda_agent.machine import usable_cores

Job = tuple[Entry, Path | None]


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
    build_workers: int = 0  # 0: half the cores (CUDA); builds run inside the worker on the CPU backend
    overlap_builds: bool | None = None  # None: on CUDA only (CPU builds would disturb CPU timing)
    eval_options: dict[str, Any] = field(default_factory=dict)  # passed to EvalOptions
    agent: AgentSpec | None = None
    ray_address: str | None = None


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


def evaluate_job(entry: Entry, solution: Path | None, cfg: BenchConfig, slot: Slot, out: Path) -> BenchRecord:
    """One task on one slot; never raises (a failure is a record)."""
    from cuda_agent.evaluator.evaluate import evaluate
    from cuda_agent.evaluator.solution import SolutionError, load_solution

    t0 = time.perf_counter()
    base = {"worker": slot.name, "gpu": slot.gpu}
    if cfg.agent is not None:
        return _agent_job(entry, cfg, slot, out, t0)
    if solution is None:
        return BenchRecord(key=entry.key, task_id=entry.task.id, task_name=entry.task.name, level=entry.level,
                           status=MISSING, message="no solution for this task in the solutions folder", **base)
    try:
        res = evaluate(entry.task, load_solution(solution), eval_options(cfg, slot))
    except SolutionError as exc:
        return BenchRecord(key=entry.key, task_id=entry.task.id, task_name=entry.task.name, level=entry.level,
                           status="rejected", message=str(exc), solution=str(solution),
                           seconds=round(time.perf_counter() - t0, 3), **base)
    except Exception as exc:  # the evaluator itself failed: keep going, say so
        return BenchRecord(key=entry.key, task_id=entry.task.id, task_name=entry.task.name, level=entry.level,
                           status=ERROR, message=f"{type(exc).__name__}: {exc}"[:1000], solution=str(solution),
                           seconds=round(time.perf_counter() - t0, 3), **base)
    return from_eval(entry.key, entry.level, res, solution=str(solution),
                     seconds=round(time.perf_counter() - t0, 3), **base)


def _agent_job(entry: Entry, cfg: BenchConfig, slot: Slot, out: Path, t0: float) -> BenchRecord:
    import asyncio

    from cuda_agent.agent import AgentConfig, OpenAIClient, OpenAIConfig, ReplayClient, run_episode
    from cuda_agent.agent.client import load_script

    spec = cfg.agent
    assert spec is not None
    ep_dir = out / "episodes" / entry.level / entry.task.name.replace("/", "_")
    base = {"worker": slot.name, "gpu": slot.gpu, "trajectory": str(ep_dir / "trajectory.jsonl")}
    try:
        client: Any = ReplayClient(load_script(spec.replay)) if spec.replay else OpenAIClient(OpenAIConfig(
            model=spec.model or "", base_url=spec.base_url, api_key=spec.api_key, temperature=spec.temperature))
        acfg = AgentConfig(max_turns=spec.max_turns, context_tokens=spec.context_tokens, wall_time_s=spec.wall_time_s,
                           score_every_build=spec.score_every_build,
                           sandbox=cfg.eval_options.get("sandbox", True), gpu_index=slot.gpu)
        resume = (ep_dir / "trajectory.jsonl").exists()
        s = asyncio.run(run_episode(entry.task, client, ep_dir, device=cfg.device, config=acfg, resume=resume,
                                    eval_lock=slot.lock))
    except Exception as exc:
        return BenchRecord(key=entry.key, task_id=entry.task.id, task_name=entry.task.name, level=entry.level,
                           status=ERROR, message=f"{type(exc).__name__}: {exc}"[:1000],
                           seconds=round(time.perf_counter() - t0, 3), **base)
    final = s.final or {}
    return BenchRecord(key=entry.key, task_id=entry.task.id, task_name=entry.task.name, level=entry.level,
                       status="ok" if s.correct else str(final.get("status") or "failed"), correct=s.correct,
                       reward=s.reward, speedup_vs_eager=s.speedup_vs_eager, speedup_vs_compile=s.speedup_vs_compile,
                       flags=list(final.get("flags") or []), rule=final.get("rule"),
                       message=f"{s.reason} after {s.turns} turns; best from {s.best_from}",
                       solution=str(ep_dir / "best") if s.correct else None,
                       seconds=round(time.perf_counter() - t0, 3), **base)


def _prebuild(entry: Entry, solution: Path, cfg: BenchConfig) -> None:
    from cuda_agent.evaluator.evaluate import EvalOptions, prebuild
    from cuda_agent.evaluator.solution import load_solution

    try:
        prebuild(entry.task, load_solution(solution), EvalOptions(device=cfg.device, **cfg.eval_options))
    except Exception:
        pass  # the evaluation will say what is wrong


def plan(entries: list[Entry], solutions: Path | None, results: ResultsFile, resume: bool) -> tuple[list[Job], int]:
    done = latest(results.read()) if resume else {}
    todo = [e for e in entries if e.key not in done]
    jobs = [(e, find_solution(e, solutions) if solutions is not None else None) for e in todo]
    return jobs, len(entries) - len(todo)


def run_local(jobs: list[Job], cfg: BenchConfig, out: Path, results: ResultsFile,
              on_record: Callable[[BenchRecord], None] | None = None) -> list[BenchRecord]:
    slots = slots_for(cfg)
    per_slot = cfg.agent.episodes_per_device if cfg.agent else 1
    overlap = cfg.overlap_builds if cfg.overlap_builds is not None else cfg.device == "cuda"
    ready: queue.Queue[Job | None] = queue.Queue()
    records: list[BenchRecord] = []
    lock = threading.Lock()

    def feed() -> None:
        if overlap and cfg.agent is None:
            n = cfg.build_workers or max(1, usable_cores() // 2)
            with cf.ThreadPoolExecutor(n, thread_name_prefix="cuda-agent-build") as pool:
                futs = {pool.submit(_prebuild, e, s, cfg): (e, s) for e, s in jobs if s is not None}
                for e, s in jobs:
                    if s is None:
                        ready.put((e, s))
                for f in cf.as_completed(futs):
                    ready.put(futs[f])
        else:
            for j in jobs:
                ready.put(j)
        for _ in range(len(slots) * per_slot):
            ready.put(None)

    def work(slot: Slot) -> None:
        while True:
            job = ready.get()
            if job is None:
                return
            rec = evaluate_job(job[0], job[1], cfg, slot, out)
            results.append(rec)
            with lock:
                records.append(rec)
            if on_record is not None:
                on_record(rec)

    threads = [threading.Thread(target=feed, daemon=True, name="cuda-agent-feed")]
    threads += [threading.Thread(target=work, args=(s,), daemon=True, name=f"cuda-agent-{s.name}-{k}")
                for s in slots for k in range(per_slot)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def run_bench(entries: list[Entry], out: Path, *, solutions: Path | None, cfg: BenchConfig, resume: bool = False,
              on_record: Callable[[BenchRecord], None] | None = None,
              on_plan: Callable[[int, int], None] | None = None) -> list[BenchRecord]:
    """Evaluate the suite; returns the latest record of every task (earlier runs included)."""
    out.mkdir(parents=True, exist_ok=True)
    results = ResultsFile(out / "results.jsonl")
    if results.path.exists() and not resume:
        raise ValueError(f"{results.path} exists: pass --resume to continue that run, or another --out")
    jobs, skipped = plan(entries, solutions, results, resume)
    if on_plan is not None:
        on_plan(len(jobs), skipped)
    if cfg.ray_address:
        from cuda_agent.bench.ray_pool import run_ray

        run_ray(jobs, cfg, out, results, on_record)
    else:
        run_local(jobs, cfg, out, results, on_record)
    keys = {e.key for e in entries}
    return [r for k, r in latest(results.read()).items() if k in keys]
