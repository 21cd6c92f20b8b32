"""A benchmark suite: its tasks (with their level) and where each task's solution is.

Solutions are matched to tasks by name in a solutions folder, in this order:

1. `DIR/NAME/` holding `model_new.py` (a workspace: `kernels/` beside it, or single-file)
2. `DIR/LEVEL/NAME/` (the same, mirroring the suite's folders)
3. `DIR/NAME.py`, `DIR/LEVEL/NAME.py`, `DIR/NAME/model_new.py` ... (KernelBench single files)
4. KernelBench generation names: `level_1_problem_19_sample_0_kernel.py` (or `level1_problem_19...`)
   for task `19_...` of level `level1`

A task with no solution is reported as such (status `missing`, a failure), never skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.tasks import Task, load_tasks

_GENERATED = re.compile(r"^level_?(\d+)_problem_(\d+)(?:_sample_(\d+))?(?:_kernel)?\.py$")


@dataclass(frozen=True)
class Entry:
    task: Task
    level: str  # the task's folder ("level1"), or "all" for a flat suite

    @property
    def key(self) -> str:
        """Unique within a suite: results are keyed by it (resume)."""
        return f"{self.level}/{self.task.name}#{self.task.id}"


def load_suite(path: str | Path, *, pattern: str = "*.py") -> list[Entry]:
    tasks = load_tasks(path, pattern=pattern)
    return [Entry(task=t, level=t.level or "all") for t in tasks]


def _problem_number(name: str) -> int | None:
    m = re.match(r"^(\d+)_", name)
    return int(m.group(1)) if m else None


def _level_number(level: str) -> int | None:
    m = re.search(r"(\d+)$", level)
    return int(m.group(1)) if m else None


def find_solution(entry: Entry, root: Path) -> Path | None:
    """The solution of `entry` under `root`, or None."""
    name = entry.task.name.split("/")[-1]
    for base in (root / name, root / entry.level / name):
        if (base / "model_new.py").is_file():
            return base
    for f in (root / f"{name}.py", root / entry.level / f"{name}.py"):
        if f.is_file():
            return f
    problem, level = _problem_number(name), _level_number(entry.level)
    if problem is None:
        return None
    best: tuple[int, Path] | None = None
    for f in sorted(root.rglob("level*problem_*.py")):
        m = _GENERATED.match(f.name)
        if not m or int(m.group(2)) != problem:
            continue
        if level is not None and int(m.group(1)) != level:
            continue
        sample = int(m.group(3) or 0)
        if best is None or sample < best[0]:  # the first sample, as KernelBench's eval does by default
            best = (sample, f)
    return best[1] if best else None
