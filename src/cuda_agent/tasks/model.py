"""The task model: `Task`, its content-hash id, and `TaskError`."""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass, field
from typing import Any

#: Module-level names every task must define.
REQUIRED_NAMES: tuple[str, ...] = ("Model", "get_inputs", "get_init_inputs")

_ID_LEN = 16


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
