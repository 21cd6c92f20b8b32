"""Loading tasks: one `.py` file, a folder tree of them, or a `.jsonl` / `.json` /
`.parquet` dataset of rows with a `code` field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cuda_agent.tasks.model import Task, TaskError, compute_task_id
from cuda_agent.tasks.naming import folder_sort_key, unique_names
from cuda_agent.tasks.validate import check_code, task_from_code

_ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
_PYARROW_HINT = "pip install pyarrow (or pip install 'cuda-agent[data]')"


def _read_text(path: Path) -> str:
    """Read a UTF-8 text file exactly (no newline translation); TaskError otherwise."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise TaskError(f"{path} is a directory, expected a file") from None
    except OSError as exc:
        raise TaskError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if b"\x00" in data:
        raise TaskError(f"{path} looks like a binary file (it contains NUL bytes)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path} is not valid UTF-8 (bad byte at offset {exc.start})") from None


def load_task_file(path: str | Path) -> Task:
    """Load and validate one task file; its name is the file stem, its level None."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p} does not exist")
    return task_from_code(_read_text(p), name=p.stem, source=str(p))


def _is_candidate(rel: Path) -> bool:
    *dirs, filename = rel.parts
    if any(d.startswith(".") or d == "__pycache__" for d in dirs):
        return False
    return not (filename.startswith(("_", ".")) or filename == "__init__.py")


def _load_folder(
    root: Path, pattern: str, skip_invalid: bool
) -> tuple[list[Task], list[tuple[str, str]]]:
    files = [
        p.relative_to(root)
        for p in root.rglob(pattern)
        if p.is_file() and _is_candidate(p.relative_to(root))
    ]
    if not files:
        raise TaskError(f"no task files found under {root} (pattern {pattern!r})")
    files.sort(key=folder_sort_key)
    names = unique_names(
        [(rel.stem, rel.with_suffix("").as_posix(), rel.as_posix()) for rel in files]
    )
    tasks: list[Task] = []
    skipped: list[tuple[str, str]] = []
    for rel, name in zip(files, names, strict=True):
        path = root / rel
        level = rel.parent.name if rel.parent != Path(".") else None
        try:
            tasks.append(task_from_code(_read_text(path), name=name, source=str(path), level=level))
        except TaskError as exc:
            if not skip_invalid:
                raise
            skipped.append((str(path), str(exc)))
    if not tasks:
        raise TaskError(
            f"no valid tasks under {root}: all {len(skipped)} file(s) were skipped, "
            f"first: {skipped[0][1]}"
        )
    return tasks, skipped


# --------------------------------------------------------------------------- reading rows


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (location, row-or-TaskError) per non-empty line."""
    text = _read_text(path)
    index = 0
    # Split on "\n" only: str.splitlines() would also split on U+2028 etc. inside strings.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        loc = f"row {index} (line {lineno})"
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            row = TaskError(
                f"{path}: line {lineno} is not valid JSON: {exc.msg} (column {exc.colno})"
            )
        except RecursionError:
            row = TaskError(f"{path}: line {lineno} is nested too deeply to parse")
        yield loc, row
        index += 1


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    text = _read_text(path)
    if not text.strip():
        raise TaskError(f"{path} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise TaskError(f"{path} is nested too deeply to parse") from None
    if not isinstance(data, list):
        raise TaskError(f"{path} must contain a JSON list of rows, got {type(data).__name__}")
    for index, row in enumerate(data):
        yield f"row {index}", row


def import_pyarrow(path: Path, action: str) -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError(
            f"{action} {path} needs pyarrow, which is not installed: {_PYARROW_HINT}"
        ) from None
    return pq


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    pq = import_pyarrow(path, "reading")
    if not path.is_file():
        raise TaskError(f"{path} is not a file")
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several exception types for bad files
        raise TaskError(f"{path} is not a readable parquet file: {exc}") from None
    for index, row in enumerate(rows):
        yield f"row {index}", row


def _load_rows(path: Path, skip_invalid: bool) -> tuple[list[Task], list[tuple[str, str]]]:
    suffix = path.suffix.lower()
    reader = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}[suffix]
    stem = path.stem
    pending: list[tuple[int, str, str, dict[str, Any]]] = []  # index, preferred name, code, meta
    skipped: list[tuple[str, str]] = []
    index = -1
    for index, (loc, row) in enumerate(reader(path)):
        source = f"{path}#{index}"
        try:
            if isinstance(row, TaskError):
                raise row
            if not isinstance(row, dict):
                raise TaskError(f"{path}: {loc} is not an object, got {type(row).__name__}")
            if "code" not in row:
                raise TaskError(f"{path}: {loc} has no 'code' field")
            code = row["code"]
            if not isinstance(code, str):
                raise TaskError(
                    f"{path}: {loc} has a non-string 'code' field ({type(code).__name__})"
                )
            name = row.get("name")
            if name is None or name == "":
                name = row.get("task_id") if isinstance(row.get("task_id"), str) else None
            name = str(name) if name not in (None, "") else f"{stem}_{index:05d}"
            meta = {k: v for k, v in row.items() if k not in ("code", "name")}
            if suffix == ".parquet":  # a column cannot be absent from a row, only null
                meta = {k: v for k, v in meta.items() if v is not None}
            if meta.get("task_id") == compute_task_id(code):
                del meta["task_id"]  # redundant: it is Task.id
            check_code(code, source)
        except TaskError as exc:
            if not skip_invalid:
                raise
            skipped.append((source, str(exc)))
            continue
        pending.append((index, name, code, meta))
    if index < 0:
        raise TaskError(f"{path} contains no rows")
    if not pending:
        raise TaskError(
            f"no valid tasks in {path}: all {len(skipped)} row(s) were skipped, "
            f"first: {skipped[0][1]}"
        )
    names = unique_names([(name, f"{name}#{i}") for i, name, _, _ in pending])
    tasks = [
        Task(
            id=compute_task_id(code),
            name=final,
            code=code,
            source=f"{path}#{i}",
            level=None,
            meta=meta,
        )
        for (i, _, code, meta), final in zip(pending, names, strict=True)
    ]
    return tasks, skipped


# --------------------------------------------------------------------------- public loaders


def load_tasks_report(
    path: str | Path, *, pattern: str = "*.py", skip_invalid: bool = False
) -> tuple[list[Task], list[tuple[str, str]]]:
    """Like :func:`load_tasks`, also returning the ``(source, reason)`` pairs skipped
    because of ``skip_invalid=True`` (always empty when it is False)."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p} does not exist")
    if p.is_dir():
        return _load_folder(p, pattern, skip_invalid)
    suffix = p.suffix.lower()
    if suffix == ".py":
        return [load_task_file(p)], []
    if suffix in _ROW_SUFFIXES:
        return _load_rows(p, skip_invalid)
    raise TaskError(
        f"{p} has an unsupported type {suffix or '(no suffix)'!r}: expected a .py file, "
        "a folder of them, or a .jsonl, .json or .parquet dataset"
    )


def load_tasks(
    path: str | Path, *, pattern: str = "*.py", skip_invalid: bool = False
) -> list[Task]:
    """Load tasks from a ``.py`` file, a folder tree, or a ``.jsonl``/``.json``/``.parquet``
    dataset.

    Folders are searched recursively for ``pattern`` (skipping ``__init__.py``, names
    starting with ``_`` or ``.``, hidden folders and ``__pycache__``) and sorted by folder,
    then by the numeric filename prefix (``2_x`` before ``10_x``).  Every task is
    validated; with ``skip_invalid=True`` invalid files or rows are skipped instead (see
    :func:`load_tasks_report` for what was skipped).  Raises :class:`TaskError`.
    """
    return load_tasks_report(path, pattern=pattern, skip_invalid=skip_invalid)[0]
