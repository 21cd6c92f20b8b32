"""How a spare process (see `warm`) waits: its host stage, then the go, its device stage,
then its job. Imported by the sandboxed reference, candidate and baseline processes, so it
imports nothing of its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

GO = ".spare-go"  # in the process's working directory: its device stage may start
READY = ".spare-ready"  # written there once it waits for its job


def wait_for(paths: list[Path], deadline: float) -> bool:
    """Poll until one of `paths` exists (files are written whole, by a rename); False at
    `deadline` (time.monotonic())."""
    while not any(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def wait_as_spare(argv: list[str], host: Callable[[str], None], device: Callable[[str], None]) -> dict[str, float] | None:
    """`argv` = [SPEC, "--wait", DEVICE, IDLE_S]: run `host(DEVICE)`, wait for the go (or
    the job itself, which needs the device now), run `device(DEVICE)`, mark the process
    ready and wait for SPEC. Returns the seconds of each stage once SPEC is there; None
    when nobody came within IDLE_S (a spare that was not needed)."""
    spec, deadline = Path(argv[0]), time.monotonic() + float(argv[3])
    t0 = time.perf_counter()
    host(argv[2])
    t1 = time.perf_counter()
    if not wait_for([Path(GO), spec], deadline):
        return None
    t2 = time.perf_counter()
    device(argv[2])
    t3 = time.perf_counter()
    Path(READY).write_text(f"{t3 - t0:.3f}")
    if not wait_for([spec], deadline):
        return None
    return {"warmed up ahead (s)": round(t3 - t0 - (t2 - t1), 4), "warm-up, host (s)": round(t1 - t0, 4),
            "waited for the go (s)": round(t2 - t1, 4), "warm-up, device (s)": round(t3 - t2, 4)}
