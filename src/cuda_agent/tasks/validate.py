"""Static validation of a task's code (through its AST; nothing is executed), and
`task_from_code`, which builds a `Task` from code that passes."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from cuda_agent.tasks.model import REQUIRED_NAMES, Task, TaskError, compute_task_id


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


def check_code(code: str, where: str) -> None:
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
    check_code(code, where)
    return Task(
        id=compute_task_id(code),
        name=name,
        code=code,
        source=source,
        level=level,
        meta=dict(meta) if meta else {},
    )
