"""One broken rule, and the de-duplicated, line-ordered list every check returns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken rule, located in a solution file."""

    rule: str
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line > 0 else self.file
        return f"{where}: [{self.rule}] {self.message}"


def dedupe(violations: Iterable[Violation]) -> list[Violation]:
    """Violations ordered by line, each reported once."""
    seen: set[tuple[str, str, int, str]] = set()
    out: list[Violation] = []
    for v in sorted(violations, key=lambda v: v.line):
        key = (v.rule, v.file, v.line, v.message)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out
