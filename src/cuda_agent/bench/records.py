"""Benchmark result records: one JSON line per task, appended as each task completes."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda_agent.bench.suite import Entry

RECORD_VERSION = 1
MISSING = "missing"  # no solution for the task: a failure
ERROR = "error"  # the benchmark could not evaluate it (the evaluator raised)


@dataclass
class BenchRecord:
    key: str
    task_id: str
    task_name: str
    level: str
    status: str
    correct: bool = False
    reward: float = -1.0
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    times_us: dict[str, float] = field(default_factory=dict)  # medians: candidate, eager, compile
    flags: list[str] = field(default_factory=list)
    rule: str | None = None
    message: str = ""
    solution: str | None = None
    trajectory: str | None = None
    worker: str | None = None
    gpu: int | None = None
    seconds: float = 0.0
    v: int = RECORD_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchRecord:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def for_entry(cls, entry: Entry, status: str, **fields: Any) -> BenchRecord:
        """A record of the entry's task: its key, task and level, then `status` and `fields`."""
        return cls(key=entry.key, task_id=entry.task.id, task_name=entry.task.name,
                   level=entry.level, status=status, **fields)

    @classmethod
    def error(cls, entry: Entry, exc: BaseException, **fields: Any) -> BenchRecord:
        """The benchmark could not finish the entry's task because of `exc`."""
        return cls.for_entry(entry, ERROR, message=exc_message(exc), **fields)

    @classmethod
    def from_eval(cls, entry: Entry, res: Any, **extra: Any) -> BenchRecord:
        """A record from an evaluator result (`EvalResult`) for the entry's task."""
        return cls(
            key=entry.key, task_id=res.task_id, task_name=res.task_name, level=entry.level,
            status=res.status, correct=res.correct, reward=res.reward,
            speedup_vs_eager=res.speedup_vs_eager, speedup_vs_compile=res.speedup_vs_compile,
            times_us={k: v["median_us"] for k, v in (res.times_us or {}).items()
                      if "median_us" in v},
            flags=list(res.flags), rule=res.rule, message=res.message[:1000], **extra)


def exc_message(exc: BaseException) -> str:
    """An exception as a record's message: its type and text, bounded."""
    return f"{type(exc).__name__}: {exc}"[:1000]


class ResultsFile:
    """Append-only JSONL; each record is flushed and synced before the next task counts as done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def read(self) -> list[BenchRecord]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a torn last line after a kill
            if isinstance(d, dict) and "key" in d and "status" in d:
                out.append(BenchRecord.from_dict(d))
        return out

    def append(self, rec: BenchRecord) -> None:
        line = json.dumps(rec.to_dict(), ensure_ascii=False)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                if f.tell() > 0:
                    # a kill can leave a torn last line: start on a fresh one
                    with open(self.path, "rb") as r:
                        r.seek(-1, os.SEEK_END)
                        if r.read(1) != b"\n":
                            f.write("\n")
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())


def latest(records: list[BenchRecord]) -> dict[str, BenchRecord]:
    """The last record of each task (a re-run replaces an earlier one)."""
    out: dict[str, BenchRecord] = {}
    for r in records:
        out[r.key] = r
    return out
