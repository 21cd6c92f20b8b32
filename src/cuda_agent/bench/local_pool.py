"""The benchmark's agent episodes on this machine: one worker thread per device slot.

Each worker runs `episodes_per_device` episodes at once on its slot, their evaluations
taking turns. (Solutions go to the evaluation service, `service_pool.py`, which builds
them ahead of the GPUs; a solution job given here is evaluated in the worker.)
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from cuda_agent.bench.jobs import (
    BenchConfig,
    Job,
    OnRecord,
    Slot,
    evaluate_job,
    slots_for,
)


def run_local(jobs: list[Job], cfg: BenchConfig, out: Path, record: OnRecord) -> None:
    slots = slots_for(cfg)
    per_slot = cfg.agent.episodes_per_device if cfg.agent else 1
    ready: queue.Queue[Job | None] = queue.Queue()
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

    threads = [threading.Thread(target=work, args=(s,), daemon=True,
                                 name=f"cuda-agent-{s.name}-{k}")
                for s in slots for k in range(per_slot)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
