"""The skeleton every sandboxed evaluator process shares (reference, candidate, baseline).

    python -m cuda_agent.evaluator.KIND SPEC.json                   run the job now
    python -m cuda_agent.evaluator.KIND SPEC.json --wait DEVICE IDLE_S   a spare (see `warm`)

A spare warms up in two stages before its job is known: the host stage (imports: on CUDA
at once, since it does not touch the device a measurement may be using), then, after the
go (`protocol.SPARE_GO` in its cwd) or the spec itself, the device stage (on CUDA the
context and the kind's own warm-up; on the CPU the imports too). It then marks its cwd
`protocol.SPARE_READY` and waits for SPEC.json, written whole by the evaluator. A spare
nobody takes within IDLE_S exits quietly.

Imported first by the sandboxed processes: it imports nothing heavy of its own.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.evaluator.protocol import SPARE_GO, SPARE_READY


def wait_for(paths: list[Path], deadline: float) -> bool:
    """Poll until one of `paths` exists (files are written whole, by a rename); False at
    `deadline` (time.monotonic())."""
    while not any(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@dataclass(frozen=True)
class Warmup:
    """What a kind of process does before its job: `imports` (host only) and, on CUDA,
    `cuda` after the context is created."""

    imports: Callable[[], None]
    cuda: Callable[[], None] | None = None

    def host(self, device: str) -> None:
        if device == "cuda":
            self.imports()

    def device(self, device: str) -> None:
        self.imports()
        if device == "cuda":
            import torch

            torch.cuda.init()
            if self.cuda is not None:
                self.cuda()


def wait_as_spare(spec: Path, device: str, idle_s: float, warmup: Warmup) -> dict[str, float] | None:
    """The spare's stages (see the module docstring). Returns the seconds of each stage
    once `spec` is there; None when nobody came within `idle_s`."""
    deadline = time.monotonic() + idle_s
    t0 = time.perf_counter()
    warmup.host(device)
    t1 = time.perf_counter()
    if not wait_for([Path(SPARE_GO), spec], deadline):
        return None
    t2 = time.perf_counter()
    warmup.device(device)
    t3 = time.perf_counter()
    Path(SPARE_READY).write_text(f"{t3 - t0:.3f}")
    if not wait_for([spec], deadline):
        return None
    return {"warmed up ahead (s)": round(t3 - t0 - (t2 - t1), 4), "warm-up, host (s)": round(t1 - t0, 4),
            "waited for the go (s)": round(t2 - t1, 4), "warm-up, device (s)": round(t3 - t2, 4)}


def run(argv: list[str], job: Callable[[Path, dict[str, float]], int], warmup: Warmup,
        hard_exit: bool = True) -> None:
    """Run `job(spec, spare_stages)` as the process's life and exit with its status.

    `hard_exit`: once the job's files are written and closed, skip the interpreter's and
    CUDA's teardown (every tensor's destructor, the context), which the evaluator would
    otherwise wait for. Off for processes whose exit handlers must run (torch.compile's
    worker processes would hold the output pipes open)."""
    stages: dict[str, float] | None = {}
    if len(argv) == 4 and argv[1] == "--wait":
        stages = wait_as_spare(Path(argv[0]), argv[2], float(argv[3]), warmup)
    rc = 0 if stages is None else job(Path(argv[0]), stages)
    if not hard_exit:
        sys.exit(rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
