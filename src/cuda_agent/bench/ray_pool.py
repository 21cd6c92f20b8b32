"""The benchmark's jobs on Ray: one actor per GPU (or per CPU worker), same records.

Each actor holds one GPU of the cluster (`num_gpus=1`) and evaluates one job at a time
through the same `evaluate_job` as the local pool, with the GPU Ray assigned to it. The
candidate runs in its own sandboxed process, so a hostile kernel cannot break the actor's
state; if an actor dies anyway, its job is recorded as an error and Ray restarts the actor
for the next job. The driver hands each record on as its job finishes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cuda_agent.bench.jobs import BenchConfig, Job, OnRecord, Slot, evaluate_job, slots_for
from cuda_agent.bench.records import ERROR, BenchRecord, exc_message


class _Worker:
    def __init__(self, cfg: BenchConfig, name: str, threads: int | None) -> None:
        self.cfg = cfg
        self.name = name
        self.threads = threads

    def run(self, job: Job, out: str) -> dict[str, Any]:
        import ray

        gpu = None
        if self.cfg.device == "cuda":
            ids = ray.get_gpu_ids()
            gpu = int(ids[0]) if ids else 0
        slot = Slot(self.name, gpu, self.threads)
        return evaluate_job(job[0], job[1], self.cfg, slot, Path(out)).to_dict()


def run_ray(jobs: list[Job], cfg: BenchConfig, out: Path, record: OnRecord) -> None:
    try:
        import ray
    except ImportError as exc:
        raise ValueError("--ray needs the ray package (pip install 'ray[default]')") from exc
    from ray.util import ActorPool

    started = not ray.is_initialized()
    if started:
        address = None if cfg.ray_address in ("local", None) else cfg.ray_address
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    try:
        if cfg.device == "cuda":
            n = int(ray.cluster_resources().get("GPU", 0))
            if n < 1:
                raise ValueError("the Ray cluster has no GPUs")
            slots = [Slot(f"ray-gpu{i}", None, None) for i in range(n)]
            actor_cls = ray.remote(num_gpus=1, num_cpus=1, max_restarts=3)(_Worker)
        else:
            slots = slots_for(cfg)
            actor_cls = ray.remote(num_cpus=0, max_restarts=3)(_Worker)
        actors = [actor_cls.remote(cfg, f"ray-{s.name}", s.threads) for s in slots]
        pool = ActorPool(actors)
        for job in jobs:
            pool.submit(lambda a, j: a.run.remote(j, str(out)), job)
        pending = list(jobs)
        err = "unknown error"
        while pool.has_next():
            try:
                rec = BenchRecord.from_dict(pool.get_next_unordered())
            except ray.exceptions.RayError as exc:  # an actor died mid-job: which job is unknown here
                err = exc_message(exc)
                continue
            pending = [j for j in pending if j[0].key != rec.key]
            record(rec)
        for entry, sol in pending:  # jobs lost with a dead actor
            record(BenchRecord.for_entry(entry, ERROR,
                                         message=f"the Ray worker died during this task ({err})",
                                         solution=str(sol) if sol else None))
    finally:
        if started:
            ray.shutdown()
