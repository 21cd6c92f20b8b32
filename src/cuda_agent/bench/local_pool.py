"""The benchmark's jobs on this machine: one worker thread per device slot.

Each worker drives sandboxed evaluator processes on its slot, one job at a time (or, for
agent episodes, `episodes_per_device` at once, their evaluations taking turns). On CUDA
the builds (CPU work) run ahead on a separate build pool, into the content-hash build
cache, so a worker's GPU is busy timing one solution while the next ones compile.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from pathlib import Path

from cuda_agent.bench.jobs import (
    BenchConfig,
    Job,
    OnRecord,
    Slot,
    evaluate_job,
    prebuild_job,
    slots_for,
)
from cuda_agent.machine import usable_cores


def run_local(jobs: list[Job], cfg: BenchConfig, out: Path, record: OnRecord) -> None:
    slots = slots_for(cfg)
    per_slot = cfg.agent.episodes_per_device if cfg.agent else 1
    overlap = cfg.overlap_builds if cfg.overlap_builds is not None else cfg.device == "cuda"
    ready: queue.Queue[Job | None] = queue.Queue()

    def feed() -> None:
        if overlap and cfg.agent is None:
            n = cfg.build_workers or max(1, usable_cores() // 2)
            with cf.ThreadPoolExecutor(n, thread_name_prefix="cuda-agent-build") as pool:
                futs = {pool.submit(prebuild_job, e, s, cfg): (e, s)
                        for e, s in jobs if s is not None}
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
            record(evaluate_job(job[0], job[1], cfg, slot, out))

    threads = [threading.Thread(target=feed, daemon=True, name="cuda-agent-feed")]
    threads += [threading.Thread(target=work, args=(s,), daemon=True,
                                 name=f"cuda-agent-{s.name}-{k}")
                for s in slots for k in range(per_slot)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
