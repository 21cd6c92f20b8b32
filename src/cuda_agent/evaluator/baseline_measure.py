"""Measuring a task's baselines in the trusted baseline process (`baseline_run`), for
an evaluation or ahead of one, and caching them (`baselines`)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

from cuda_agent import sandbox
from cuda_agent.evaluator import baselines, processes, protocol, timing, warm
from cuda_agent.evaluator.options import EvalOptions
from cuda_agent.evaluator.protocol import BaselineLayout, BaselineReport, BaselineSpec
from cuda_agent.paths import short_hash
from cuda_agent.tasks import Task

# baselines do not depend on an evaluation's seeds; they are timed on the same kinds of
# inputs as the candidate (the task's, and the default distribution trials')
BASELINE_DISTRIBUTIONS = EvalOptions().trial_distributions()
BASELINE_SEEDS = [7001 + k for k in range(len(BASELINE_DISTRIBUTIONS))]


def hash_protocol(p: timing.Protocol) -> int:
    """A small stable number for the protocol's settings (part of the baseline cache key)."""
    return int(short_hash(json.dumps(dataclasses.asdict(p), sort_keys=True), n=6), 16) % 1000


def baseline_key(task: Task, opts: EvalOptions, device: str, threads: int) -> baselines.BaselineKey:
    return baselines.BaselineKey(
        task_id=task.id, device_name=baselines.device_name(device, opts.gpu_index),
        torch_version=baselines.torch_version(),
        protocol_version=timing.PROTOCOL_VERSION * 1000 + hash_protocol(opts.protocol),
        compile_mode=opts.compile_mode, threads=threads)


class BaselineRun:
    """One baseline process for a task, started at once (a spare's when one is ready) in
    a thread that waits for it. Gated: it compiles, then waits for `go()` to measure."""

    def __init__(self, task: Task, opts: EvalOptions, device: str, threads: int, work: Path,
                 gated: bool, warm_spare: bool) -> None:
        self.opts, self.device, self.threads = opts, device, threads
        self.details: dict[str, Any] = {}  # spare use, for the record
        self.seconds = 0.0
        self.run: sandbox.RunResult | None = None
        spare = warm.POOL.take(processes.baseline_spare_key(opts, device, threads)) if warm_spare else None
        self.from_spare = spare is not None
        if spare is not None:
            self.layout = BaselineLayout(spare.work)
        else:
            self.layout = BaselineLayout(work / f"baseline-{sum(1 for _ in work.glob('baseline-*'))}").make()
        self.layout.task_code.write_text(task.code)
        self.layout.task_code.chmod(0o644)
        if not gated:
            self.go()
        timeout = opts.run_timeout_s
        if spare is not None:
            self.proc = spare.procs.pop("baseline")
            self.proc.deadline.set_in(timeout)
        BaselineSpec(base=str(self.layout.base), task_name=task.name, device=device, init_seed=0,
                     seeds=BASELINE_SEEDS, compile_mode=opts.compile_mode, threads=threads,
                     protocol=dataclasses.asdict(opts.protocol), gate_timeout_s=timeout,
                     distributions=BASELINE_DISTRIBUTIONS).write(self.layout.spec)
        if spare is None:
            self.proc = processes.baseline_proc(self.layout, opts, device, threads, timeout)
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        t0 = time.perf_counter()
        run, self.proc, spare_failed = warm.wait_retrying(
            self.proc, self.from_spare, self.layout.report.exists,
            lambda: processes.baseline_proc(self.layout, self.opts, self.device, self.threads,
                                            self.opts.run_timeout_s))
        if spare_failed:
            self.details["baseline_spare_failed"] = spare_failed
        elif self.from_spare:
            self.details["baseline_warm_start"] = True
        self.seconds = time.perf_counter() - t0
        self.run = run
        if not (self.layout.out / protocol.COMPILED).exists():
            protocol.write_marker(self.layout.out / protocol.COMPILED)

    def go(self) -> None:
        protocol.write_marker(self.layout.gate / protocol.GO)

    def compiled(self) -> bool:
        """torch.compile is done (or the process is): it may be given the device."""
        return (self.layout.out / protocol.COMPILED).exists() or not self.thread.is_alive()

    def report(self) -> BaselineReport | None:
        self.thread.join()
        return BaselineReport.read(self.layout.report, inside=self.layout.base)

    def failure(self, report: BaselineReport | None) -> str:
        why = (f"{report.error} in {report.phase}" if report else
               (self.run.describe() if self.run else "did not run"))
        return f"the baseline measurement failed: {why}"

    def kill(self) -> None:
        if self.proc.alive():
            self.proc.kill()
            try:
                self.proc.wait()
            except BaseException:
                pass
