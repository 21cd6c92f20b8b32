"""Writing tasks as JSONL or parquet rows that load back with the same id, name and code."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cuda_agent.files import atomic_write
from cuda_agent.tasks.loaders import import_pyarrow
from cuda_agent.tasks.model import Task, TaskError

_FIXED_FIELDS = ("task_id", "name", "ops", "data_source", "code")


def _row_of(task: Task) -> dict[str, Any]:
    data_source = task.meta.get("data_source")
    row: dict[str, Any] = {
        "task_id": task.id,
        "name": task.name,
        "ops": task.ops or [],
        "data_source": "" if data_source is None else str(data_source),
        "code": task.code,
    }
    for key, value in task.meta.items():
        if key not in row:
            row[key] = value
    return row


def write_jsonl(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL rows (``task_id``, ``name``, ``ops``, ``data_source``, ``code``,
    then any other ``meta`` fields); :func:`load_tasks` reads back the same id, name and
    code.  The file is replaced atomically.  Returns the path."""
    p = Path(path)
    lines: list[str] = []
    for task in tasks:
        try:
            lines.append(json.dumps(_row_of(task), ensure_ascii=False) + "\n")
        except (TypeError, ValueError) as exc:
            raise TaskError(
                f"task {task.name} has meta that cannot be written as JSON: {exc}"
            ) from None
    return atomic_write(p, "".join(lines))


def write_parquet(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as a parquet table with the same columns as :func:`write_jsonl`
    (``ops`` as ``list<string>``; extra ``meta`` columns have inferred types, null where
    a task lacks them; null meta fields are dropped when parquet rows are read back).
    Needs pyarrow.  Returns the path."""
    p = Path(path)
    import_pyarrow(p, "writing")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row_of(task) for task in tasks]
    columns: dict[str, Any] = {
        "task_id": pa.array([r["task_id"] for r in rows], pa.string()),
        "name": pa.array([r["name"] for r in rows], pa.string()),
        "ops": pa.array([r["ops"] for r in rows], pa.list_(pa.string())),
        "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
        "code": pa.array([r["code"] for r in rows], pa.string()),
    }
    extra = sorted({k for r in rows for k in r} - set(_FIXED_FIELDS))
    for key in extra:
        try:
            columns[key] = pa.array([r.get(key) for r in rows])
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise TaskError(f"meta field {key!r} cannot be written to parquet: {exc}") from None
    table = pa.table(columns)
    return atomic_write(p, lambda fh: pq.write_table(table, fh))
