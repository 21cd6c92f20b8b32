"""What an evaluation is asked to do: `EvalOptions`, and which device "auto" means."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent.evaluator import distributions, timing


@dataclass
class EvalOptions:
    device: str = "auto"  # "cuda" | "cpu" | "auto"
    atol: float = 1e-2
    rtol: float = 1e-2
    trials: int = 5  # of the task's own get_inputs()
    # trials besides, on other input distributions (`distributions`); 0 leaves the verdict to
    # the task's own trials (flagged where those cannot tell a constant from the answer)
    distribution_trials: int = 3
    seed: int | None = None  # None: fresh random seeds per evaluation (recorded in the result)
    sandbox: bool = True
    gpu_index: int = 0
    arch: str | None = None
    build_timeout_s: float = 600.0
    run_timeout_s: float = 300.0
    max_processes: int = 512
    # memory of each sandboxed process (a cgroup of its own, where the evaluator runs as root);
    # None: MEMORY_SHARE of the machine's
    memory_mb: int | None = None
    build_key: str | None = None  # which kept build directory to use; default: the solution's origin
    keep_run_dir: bool = False
    jobs: int | None = None
    static_checks: bool = True  # off only to test that the runtime checks stand on their own
    profile: bool = True  # time a correct solution against eager and torch.compile
    reward_name: str = "milestone"
    threshold: float = 0.05
    compile_mode: str = "default"
    threads: int | None = None  # torch/OpenMP threads in the timed processes; default: all usable cores
    protocol: timing.Protocol = field(default_factory=timing.default_protocol)
    # The device probe beside the candidate this far off the probe beside the cached
    # baselines re-measures them (see baselines.drifted); None: 0.05 on CUDA, 0.25 on the
    # CPU (whose timings between processes are noisier).
    drift_bound: float | None = None
    baseline_cache: bool = True
    # Take a spare (reference and candidate processes started ahead, see `warm`) when one
    # is ready, and leave one for the next evaluation: for long-lived evaluators.
    warm: bool = False
    # With `warm`, also a spare baseline process for the next task whose baselines are
    # measured; None: on CUDA (where its warm-up, CUDA and the profiler, saves seconds).
    warm_baseline: bool | None = None
    # With `warm`, start the next evaluation's spare when this one takes its own, not after
    # it: its host stage (imports) overlaps this evaluation, its device stage waits for the
    # end of this one's measurements (see `warm`). None: on CUDA (on the CPU the host stage
    # would share the cores being timed, so there the spare waits whole).
    early_spare: bool | None = None

    def trial_seeds(self) -> tuple[int, list[int]]:
        """The init seed and one seed per trial (the task's, then the distribution trials'):
        fixed from `seed`, else fresh random ones."""
        n = self.trials + self.distribution_trials
        if self.seed is None:
            rng = random.SystemRandom()
            return rng.randrange(2**31), [rng.randrange(2**31) for _ in range(n)]
        return self.seed, [self.seed + 1 + k for k in range(n)]

    def trial_distributions(self) -> list[str]:
        """Each trial's input distribution, in the order of `trial_seeds`."""
        return [distributions.TASK] * self.trials + distributions.plan(self.distribution_trials)

    def memory_limit_mb(self) -> int:
        if self.memory_mb is not None:
            return self.memory_mb
        return int(physical_memory_mb() * MEMORY_SHARE)

    def drift(self, device: str) -> float:
        """The drift bound in force on `device`."""
        if self.drift_bound is not None:
            return self.drift_bound
        return 0.05 if device == "cuda" else 0.25


MEMORY_SHARE = 0.6  # of the machine's memory, one sandboxed process's limit by default


def physical_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 16 << 10


def resolve_device(device: str) -> str:
    if device in ("cuda", "cpu"):
        return device
    if device != "auto":
        raise ValueError(f"unknown device {device!r}; use cuda, cpu or auto")
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
