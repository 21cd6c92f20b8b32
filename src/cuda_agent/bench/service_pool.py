"""The benchmark's solutions through the evaluation service: the same code path as
`cuda-agent serve` and the RL reward.

Each job's solution is one request; the service's workers (one per GPU, or CPU slots)
evaluate them, with builds run ahead on CPU threads on CUDA. With `cfg.service_url` the
requests go to a running service; without, an engine is started in this process for the
run and stopped after. The bench's judging options (profile, trials, tolerances, reward)
travel with each request; the rest (sandbox, timeouts) configure the engine it starts.
Agent episodes do not come here (`local_pool`).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path
from typing import Any

from cuda_agent.bench.jobs import BenchConfig, Job, OnRecord
from cuda_agent.bench.records import MISSING, BenchRecord


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the options a client sends with each request, the ones the service is set up with)."""
    from cuda_agent.serve.requests import CLIENT_OPTIONS

    client = {k: v for k, v in options.items() if k in CLIENT_OPTIONS}
    return client, {k: v for k, v in options.items() if k not in CLIENT_OPTIONS}


def _gpu_of(worker: str | None) -> int | None:
    return int(worker[3:]) if worker and worker.startswith("gpu") and worker[3:].isdigit() else None


def run_service(jobs: list[Job], cfg: BenchConfig, out: Path, record: OnRecord) -> None:
    from cuda_agent.serve.client import HTTPClient, LocalClient
    from cuda_agent.serve.engine import Engine, ServiceConfig

    client_opts, server_opts = split_options(dict(cfg.eval_options))
    engine: Engine | None = None
    if cfg.service_url:
        client: Any = HTTPClient(cfg.service_url, name="bench")
        parallel = 64
    else:
        sandbox = bool(server_opts.pop("sandbox", True))
        engine = Engine(ServiceConfig(device=cfg.device, gpus=list(cfg.gpus), workers=cfg.workers,
                                      build_workers=(cfg.build_workers or None) if cfg.overlap_builds is not False else 0,
                                      max_queue=max(256, len(jobs)), sandbox=sandbox,
                                      default_deadline_s=7 * 24 * 3600.0, eval_options=server_opts)).start()
        client = LocalClient(engine, name="bench")
        # enough requests in flight to keep every worker and the build threads busy
        parallel = 2 * len(engine.slots) + engine.build_workers
    try:
        with cf.ThreadPoolExecutor(max(1, parallel), thread_name_prefix="cuda-agent-bench") as pool:
            futs = [pool.submit(_one, job, client, client_opts) for job in jobs]
            for fut in cf.as_completed(futs):
                record(fut.result())
    finally:
        if engine is not None:
            engine.close(grace_s=0)


def _one(job: Job, client: Any, options: dict[str, Any]) -> BenchRecord:
    """One job's record; never raises."""
    from cuda_agent.evaluator.record import EvalResult
    from cuda_agent.evaluator.solution import SINGLE_FILE, SolutionError, load_solution

    entry, path = job
    t0 = time.perf_counter()
    if path is None:
        return BenchRecord.for_entry(entry, MISSING, message="no solution for this task in the solutions folder",
                                     worker=None, gpu=None)
    seconds = lambda: round(time.perf_counter() - t0, 3)  # noqa: E731
    try:
        sol = load_solution(path)
        files = {"model_new.py": sol.model_new} if sol.format == SINGLE_FILE else sol.files
        ans = client.evaluate(entry.task.code, entry.task.name, files, options)
    except SolutionError as exc:
        return BenchRecord.for_entry(entry, "rejected", message=str(exc), solution=str(path), seconds=seconds(),
                                     worker=None, gpu=None)
    except Exception as exc:  # the service refused or failed: a record, not a crash
        return BenchRecord.error(entry, exc, solution=str(path), seconds=seconds(), worker=None, gpu=None)
    base = {"worker": ans.get("worker"), "gpu": _gpu_of(ans.get("worker"))}
    if ans.get("status") == "done" and ans.get("result"):
        return BenchRecord.from_eval(entry, EvalResult.from_dict(ans["result"]), solution=str(path),
                                     seconds=seconds(), **base)
    return BenchRecord.error(entry, RuntimeError(f"evaluation service: {ans.get('status')}: {ans.get('error')}"),
                             solution=str(path), seconds=seconds(), **base)
