"""Loading, validating and writing KernelBench-format tasks.

A *task* is a self-contained PyTorch source file that defines, at module level:

* ``class Model(nn.Module)`` -- the reference implementation,
* ``get_inputs()`` -- returns the list of forward inputs,
* ``get_init_inputs()`` -- returns the list of constructor arguments.

The two functions may also be bound by assignment (``get_inputs = lambda: [...]``).

Tasks come from single ``.py`` files, folder trees of them (a KernelBench checkout:
``level1/19_ReLU.py``...), or datasets of rows with a ``code`` field (JSONL, JSON list,
parquet; the CUDA-Agent-Ops-6K schema ``ops`` / ``data_source`` / ``code``).

Identity and naming
-------------------
``Task.id`` is a content hash (see :func:`compute_task_id`): the same code with CRLF
line endings or trailing spaces gets the same id.  Duplicate ids in one load are kept.

``Task.name`` is unique within one load and stable for a given set of inputs:

* folder files are named by their stem (``19_ReLU``); when two files share a stem,
  *every* file with that stem is named by its path relative to the loaded root, without
  the ``.py`` suffix (``level1/19_ReLU`` and ``level2/19_ReLU``);
* rows are named by their ``name`` field (else a non-empty string ``task_id`` field),
  else ``f"{dataset_stem}_{row_index:05d}"``; when several rows share a name, every one
  of them becomes ``f"{name}#{row_index}"``;
* if a collision somehow remains, later tasks get a ``~2``, ``~3``... suffix.

Row indices (in ``source`` such as ``data.jsonl#7`` and in messages) are 0-based and
count rows, i.e. non-empty lines of a JSONL file; JSON syntax errors name the 1-based
line number.

Every problem with the input raises :class:`TaskError` (a ``ValueError``) with one
sentence saying which file or row is at fault and what is wrong.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import tempfile
import traceback
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "REQUIRED_NAMES",
    "Task",
    "TaskError",
    "compute_task_id",
    "find_task",
    "import_task_module",
    "load_task_file",
    "load_tasks",
    "load_tasks_report",
    "task_from_code",
    "write_jsonl",
    "write_parquet",
]

#: Module-level names every task must define.
REQUIRED_NAMES: tuple[str, ...] = ("Model", "get_inputs", "get_init_inputs")

_ID_LEN = 16
_MIN_ID_PREFIX = 6
_ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
_PYARROW_HINT = "pip install pyarrow (or pip install 'cuda-agent[data]')"


class TaskError(ValueError):
    """A task file, folder or dataset row is missing, malformed or not a valid task."""


# --------------------------------------------------------------------------- identity


def compute_task_id(code: str) -> str:
    """Stable content hash of ``code``: first 16 hex chars of a sha256.

    Before hashing, line endings are normalised to ``\\n``, trailing whitespace is
    stripped from every line, and trailing blank lines are dropped, so cosmetic
    differences (CRLF, trailing spaces, a missing final newline) keep the same id.
    """
    lines = [line.rstrip() for line in code.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    normalised = "\n".join(lines)
    return hashlib.sha256(normalised.encode("utf-8")).hexdigest()[:_ID_LEN]


def _parse_ops(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
        if isinstance(value, str):
            return [value]
    if isinstance(value, (list, tuple)):
        return [str(op) for op in value]
    return None


@dataclass(frozen=True)
class Task:
    """One KernelBench-format task.  Build it with :func:`task_from_code` or a loader."""

    id: str
    name: str
    code: str = field(repr=False)
    source: str
    level: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def ops(self) -> list[str] | None:
        """Op names from ``meta['ops']`` (a list, or its string repr); None if absent."""
        return _parse_ops(self.meta.get("ops"))


# --------------------------------------------------------------------------- validation


def _where(name: str, source: str) -> str:
    return f"task {name!r}" if source == "<string>" else source


def _bound_names(targets: Iterable[ast.expr]) -> Iterator[str]:
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from _bound_names(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _bound_names([target.value])


def _module_bindings(body: Sequence[ast.stmt], found: dict[str, str]) -> None:
    """Record module-level names and what binds them: 'class', 'function', 'assign', ..."""
    for stmt in body:
        if isinstance(stmt, ast.ClassDef):
            found[stmt.name] = "class"
        elif isinstance(stmt, ast.FunctionDef):
            found[stmt.name] = "function"
        elif isinstance(stmt, ast.AsyncFunctionDef):
            found[stmt.name] = "async function"
        elif isinstance(stmt, ast.Assign):
            for name in _bound_names(stmt.targets):
                found[name] = "assign"
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            for name in _bound_names([stmt.target]):
                found[name] = "assign"
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                found[bound] = "import"
        elif isinstance(stmt, (ast.If, ast.For, ast.While, ast.With)):
            _module_bindings(stmt.body, found)
            _module_bindings(getattr(stmt, "orelse", []), found)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            _module_bindings(stmt.body, found)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                _module_bindings(handler.body, found)
            _module_bindings(stmt.orelse, found)  # type: ignore[attr-defined]
            _module_bindings(stmt.finalbody, found)  # type: ignore[attr-defined]


def _check_code(code: str, where: str) -> None:
    if not code.strip():
        raise TaskError(f"{where} is empty")
    try:
        tree = ast.parse(code, filename=where)
    except SyntaxError as exc:
        line = f" at line {exc.lineno}" if exc.lineno else ""
        raise TaskError(f"{where}: syntax error{line}: {exc.msg}") from None
    except ValueError as exc:  # e.g. null bytes on Python < 3.12
        raise TaskError(f"{where} cannot be parsed: {exc}") from None
    found: dict[str, str] = {}
    _module_bindings(tree.body, found)
    accepted = {"Model": {"class"}, "get_inputs": {"function", "assign"}}
    accepted["get_init_inputs"] = accepted["get_inputs"]
    problems: list[str] = []
    for name in REQUIRED_NAMES:
        kind = found.get(name)
        if kind is None:
            problems.append(name)
        elif kind not in accepted[name]:
            wanted = "a class" if name == "Model" else "a function"
            problems.append(f"{name} (bound by {kind}, expected {wanted})")
    if problems:
        raise TaskError(f"{where} lacks {', '.join(problems)}")


def task_from_code(
    code: str,
    *,
    name: str,
    source: str = "<string>",
    level: str | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Task:
    """Validate ``code`` statically (via the AST) and wrap it in a :class:`Task`.

    The code must parse and define, at module level, ``class Model`` and
    ``get_inputs`` / ``get_init_inputs`` (a ``def`` or an assignment).  All missing
    names are reported at once.  Nothing is executed.
    """
    if not isinstance(name, str) or not name:
        raise TaskError(f"{source}: task name must be a non-empty string, got {name!r}")
    where = _where(name, source)
    if not isinstance(code, str):
        raise TaskError(f"{where}: code must be a string, got {type(code).__name__}")
    _check_code(code, where)
    return Task(
        id=compute_task_id(code),
        name=name,
        code=code,
        source=source,
        level=level,
        meta=dict(meta) if meta else {},
    )


# --------------------------------------------------------------------------- reading files


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


def _natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part.lower())
        for part in re.split(r"(\d+)", text)
        if part
    )


def _folder_sort_key(rel: Path) -> tuple[Any, ...]:
    parent = tuple(_natural_key(part) for part in rel.parent.parts)
    match = re.match(r"\d+", rel.name)
    number = (0, int(match.group())) if match else (1, 0)
    return (parent, number, _natural_key(rel.name), rel.as_posix())


def _is_candidate(rel: Path) -> bool:
    *dirs, filename = rel.parts
    if any(d.startswith(".") or d == "__pycache__" for d in dirs):
        return False
    return not (filename.startswith(("_", ".")) or filename == "__init__.py")


def _unique_names(candidates: Sequence[Sequence[str]]) -> list[str]:
    """Pick one name per task: the first candidate, moving every member of a colliding
    group on to its next candidate; leftover clashes get ``~2``, ``~3``... suffixes."""
    level = [0] * len(candidates)
    while True:
        names = [cands[level[i]] for i, cands in enumerate(candidates)]
        counts = Counter(names)
        bumped = False
        for i, name in enumerate(names):
            if counts[name] > 1 and level[i] + 1 < len(candidates[i]):
                level[i] += 1
                bumped = True
        if not bumped:
            break
    taken: set[str] = set()
    result: list[str] = []
    for name in names:
        final, n = name, 1
        while final in taken:
            n += 1
            final = f"{name}~{n}"
        taken.add(final)
        result.append(final)
    return result


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
    files.sort(key=_folder_sort_key)
    names = _unique_names(
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


def _import_pyarrow(path: Path, action: str) -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError(
            f"{action} {path} needs pyarrow, which is not installed: {_PYARROW_HINT}"
        ) from None
    return pq


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    pq = _import_pyarrow(path, "reading")
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
            _check_code(code, source)
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
    names = _unique_names([(name, f"{name}#{i}") for i, name, _, _ in pending])
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


def find_task(tasks: Sequence[Task], key: str) -> Task:
    """Find a task by exact name, by id, by id prefix (>= 6 chars), or by the last part
    of a disambiguated name (``19_ReLU`` for ``level1/19_ReLU``) when that is unique."""
    for task in tasks:
        if task.name == key:
            return task
    lowered = key.strip().lower()
    lookups = [
        [t for t in tasks if t.id == lowered],
        [t for t in tasks if len(lowered) >= _MIN_ID_PREFIX and t.id.startswith(lowered)],
        [t for t in tasks if t.name.rsplit("/", 1)[-1] == key],
    ]
    for matches in lookups:
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            listed = ", ".join(f"{t.name} ({t.id})" for t in matches[:10])
            more = f" and {len(matches) - 10} more" if len(matches) > 10 else ""
            raise TaskError(f"{key!r} is ambiguous: it matches {listed}{more}")
    names = [t.name for t in tasks]
    close = get_close_matches(key, names, n=5, cutoff=0.5)
    close += [n for n in names if lowered and lowered in n.lower() and n not in close][
        : 5 - len(close)
    ]
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise TaskError(f"no task named {key!r} or with that id among {len(tasks)} task(s){hint}")


# --------------------------------------------------------------------------- importing


def _error_line(exc: BaseException, filename: str) -> int | None:
    if isinstance(exc, SyntaxError) and exc.filename == filename and exc.lineno:
        return exc.lineno
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            line = frame.lineno
    return line


def import_task_module(
    task: Task, module_name: str = "_cuda_agent_task", *, register: bool = False
) -> types.ModuleType:
    """Execute ``task.code`` in a fresh module object and return it.

    This runs arbitrary code: use it only in trusted reference processes.  The module is
    put in ``sys.modules`` under ``module_name`` only when ``register`` is True (and
    removed again if the import fails).  Any exception raised by the code becomes a
    :class:`TaskError`; so does a missing or non-callable ``Model``, ``get_inputs`` or
    ``get_init_inputs``.
    """
    module = types.ModuleType(module_name)
    filename = task.source
    module.__file__ = filename
    if register:
        sys.modules[module_name] = module
    try:
        compiled = compile(task.code, filename, "exec")
        exec(compiled, module.__dict__)
    except (Exception, SystemExit) as exc:
        if register and sys.modules.get(module_name) is module:
            del sys.modules[module_name]
        line = _error_line(exc, filename)
        where = f" (line {line})" if line else ""
        raise TaskError(
            f"task {task.name} failed to import: {type(exc).__name__}: {exc}{where}"
        ) from exc
    missing = [n for n in REQUIRED_NAMES if not callable(getattr(module, n, None))]
    if missing:
        if register and sys.modules.get(module_name) is module:
            del sys.modules[module_name]
        raise TaskError(f"task {task.name} imported but lacks callable {', '.join(missing)}")
    return module


# --------------------------------------------------------------------------- writing

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


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write via a temporary file in the same folder, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    _atomic_write(p, lambda fh: fh.write("".join(lines).encode("utf-8")))
    return p


def write_parquet(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as a parquet table with the same columns as :func:`write_jsonl`
    (``ops`` as ``list<string>``; extra ``meta`` columns have inferred types, null where
    a task lacks them; null meta fields are dropped when parquet rows are read back).
    Needs pyarrow.  Returns the path."""
    p = Path(path)
    _import_pyarrow(p, "writing")
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
    _atomic_write(p, lambda fh: pq.write_table(table, fh))
    return p
