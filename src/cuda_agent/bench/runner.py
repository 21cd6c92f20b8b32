"""Run a suite: evaluate existing solutions, or run the agent per task, on a pool of workers.

One record per task is appended to `results.jsonl` as it completes; `resume` skips
finished tasks. Solutions go through the evaluation service (`service_pool.py`: a running
`cuda-agent serve`, or an engine started for the run), the code path of the RL reward;
agent episodes run on the local pool (threads per device slot, see local_pool.py); `ray`
(`ray_address`) runs either on actors holding one GPU each, for many GPUs or nodes (see
ray_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cuda_agent.bench.jobs import BenchConfig, Job, OnRecord
from cuda_agent.bench.local_pool import run_local
from cuda_agent.bench.ray_pool import run_ray
from cuda_agent.bench.records import BenchRecord, ResultsFile, latest
from cuda_agent.bench.service_pool import run_service
from cuda_agent.bench.suite import Entry, find_solution


class Pool(Protocol):
    """Runs the jobs on its workers and hands each record to `record` as its job finishes
    (from any thread); returns when every job has its record."""

    def __call__(self, jobs: list[Job], cfg: BenchConfig, out: Path, record: OnRecord) -> None: ...


POOLS: dict[str, Pool] = {"service": run_service, "local": run_local, "ray": run_ray}


def make_pool(name: str) -> Pool:
    """The pool called `name`: "service", "local" or "ray"."""
    try:
        return POOLS[name]
    except KeyError:
        raise ValueError(f"unknown pool {name!r}: one of {', '.join(POOLS)}") from None


def plan(entries: list[Entry], solutions: Path | None, results: ResultsFile,
         resume: bool) -> tuple[list[Job], int]:
    done = latest(results.read()) if resume else {}
    todo = [e for e in entries if e.key not in done]
    jobs = [(e, find_solution(e, solutions) if solutions is not None else None) for e in todo]
    return jobs, len(entries) - len(todo)


def run_bench(entries: list[Entry], out: Path, *, solutions: Path | None, cfg: BenchConfig,
              resume: bool = False, on_record: OnRecord | None = None,
              on_plan: Callable[[int, int], None] | None = None) -> list[BenchRecord]:
    """Evaluate the suite; returns the latest record of every task (earlier runs included)."""
    out.mkdir(parents=True, exist_ok=True)
    results = ResultsFile(out / "results.jsonl")
    if results.path.exists() and not resume:
        raise ValueError(
            f"{results.path} exists: pass --resume to continue that run, or another --out")
    jobs, skipped = plan(entries, solutions, results, resume)
    if on_plan is not None:
        on_plan(len(jobs), skipped)

    def record(rec: BenchRecord) -> None:
        results.append(rec)
        if on_record is not None:
            on_record(rec)

    make_pool("ray" if cfg.ray_address else "local" if cfg.agent is not None else "service")(jobs, cfg, out, record)
    keys = {e.key for e in entries}
    return [r for k, r in latest(results.read()).items() if k in keys]
