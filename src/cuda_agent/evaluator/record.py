"""The evaluation result record: what crosses every process boundary as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 2

# Statuses, in the order an evaluation can fail.
OK = "ok"
COMPILE_ERROR = "compile_error"
INCORRECT = "incorrect"
REJECTED = "rejected"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
STATUSES = (OK, COMPILE_ERROR, INCORRECT, REJECTED, RUNTIME_ERROR, TIMEOUT)

# Flags: facts about a result worth a look; they do not change the verdict.
FLAG_OVER_10X = "speedup-over-10x"
FLAG_REMEASURED = "baselines-remeasured"
FLAG_EAGER_SLOWER = "eager-slower-beside-candidate"
FLAG_COMPILE_FAILED = "compile-failed-baseline-is-eager"
FLAG_COMPILE_DIFFERS = "compile-output-differs-from-eager"
FLAG_TORCH_KERNELS = "torch-kernels-in-candidate"
FLAG_WIDE_CI = "timing-ci-above-target"
FLAG_NOT_PROFILED = "not-profiled"
FLAG_OVER_BANDWIDTH = "over-bandwidth-baselines-too"
FLAG_UNVOUCHED = "in-process-time-not-vouched"  # speedups counted from the parent's own batches
# the task's outputs hardly move across its own trials (a constant passes them): the
# distribution trials decide; with none judged, the verdict says so
FLAG_BARELY_VARIES = "outputs-barely-vary"


@dataclass
class EvalResult:
    """One evaluation of one solution for one task on one device."""

    status: str
    message: str
    task_id: str
    task_name: str
    device: str
    correct: bool = False
    reward: float = -1.0
    reward_name: str = "milestone"
    rule: str | None = None
    seeds: list[int] = field(default_factory=list)
    trials_passed: int = 0
    trials: int = 0
    # every trial: {"trial", "seed", "distribution" ("" = the task's get_inputs()), "skipped"
    # (why it was not judged, or "")}; `seeds` is [init seed, *each trial's]
    trial_inputs: list[dict[str, Any]] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    solution_hash: str | None = None
    solution_format: str | None = None
    sandboxed: bool = True
    flags: list[str] = field(default_factory=list)
    # Filled in when the solution is correct and was profiled. Device time on CUDA,
    # a monotonic clock on CPU; each entry has median/min/max/mean/iterations/rel_ci/spread in us.
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    times_us: dict[str, dict[str, float]] = field(default_factory=dict)
    wall_times_us: dict[str, dict[str, float]] = field(default_factory=dict)
    wall_speedup_vs_eager: float | None = None
    wall_speedup_vs_compile: float | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def summary(self) -> str:
        """A few lines for a terminal or an agent."""
        head = f"[{self.status.upper()}] {self.task_name} on {self.device}: reward {self.reward:g}"
        parts = [head]
        if self.rule:
            parts.append(f"rule: {self.rule}")
        parts.append(self.message)
        if self.speedup_vs_eager is not None and self.speedup_vs_compile is not None:
            tm = {k: v.get("median_us", 0.0) for k, v in self.times_us.items()}
            parts.append(f"speedup {self.speedup_vs_eager:.3f}x vs eager, {self.speedup_vs_compile:.3f}x vs "
                         f"torch.compile (median us: candidate {tm.get('candidate', 0):.2f}, eager "
                         f"{tm.get('eager', 0):.2f}, compile {tm.get('compile', 0):.2f})")
        if self.flags:
            parts.append("flags: " + ", ".join(self.flags))
        t = ", ".join(f"{k} {v:.2f}s" for k, v in self.timings_s.items())
        if t:
            parts.append(f"time: {t}")
        return "\n".join(parts)
