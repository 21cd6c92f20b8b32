"""Names and lookup: the order of a folder's files, one unique name per task of a load,
and `find_task`."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from cuda_agent.tasks.model import Task, TaskError

_MIN_ID_PREFIX = 6


def _natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part.lower())
        for part in re.split(r"(\d+)", text)
        if part
    )


def folder_sort_key(rel: Path) -> tuple[Any, ...]:
    parent = tuple(_natural_key(part) for part in rel.parent.parts)
    match = re.match(r"\d+", rel.name)
    number = (0, int(match.group())) if match else (1, 0)
    return (parent, number, _natural_key(rel.name), rel.as_posix())


def unique_names(candidates: Sequence[Sequence[str]]) -> list[str]:
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
