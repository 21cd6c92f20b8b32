"""A whole solution: each file to the checks of its kind, in one list of violations."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.solution import CPP_SUFFIXES
from cuda_agent.evaluator.static_checks.cpp_rules import (
    check_cpp_source,
    check_device,
    declared_functions,
    strip_cpp,
)
from cuda_agent.evaluator.static_checks.inline_sources import extract_inline_sources
from cuda_agent.evaluator.static_checks.python_rules import check_model_new
from cuda_agent.evaluator.static_checks.violation import Violation, dedupe
from cuda_agent.evaluator.static_checks.vocabulary import MODEL_NEW


def _inline_violations(source: str, *, filename: str, device: str) -> Iterator[Violation]:
    for inline in extract_inline_sources(source):
        label = f"{filename}:{inline.kind}"
        for v in check_cpp_source(
            inline.text, filename=label, device=device, single_file=True, known_files=()
        ):
            yield Violation(v.rule, v.file, inline.python_line(v.line), v.message)


def check_solution(files: Mapping[str, str], *, device: str, single_file: bool) -> list[Violation]:
    """Check every file of a solution; paths are relative to the workspace root.

    ``model_new.py`` gets the Python rules; ``.cu``/``.cuh``/``.cpp``/``.cc``/``.h``/
    ``.hpp`` (and similar) files get the C++ rules; any other ``.py`` file is a
    ``forbidden-import`` violation; other files are ignored. In the single-file format the
    ``cpp_sources``/``cuda_sources`` given to ``load_inline`` are checked as C++ and
    reported as ``model_new.py:cuda_sources`` with the line in ``model_new.py``.
    """
    check_device(device)
    normalised = {posixpath.normpath(p.replace("\\", "/")).lstrip("/"): t for p, t in files.items()}
    known = frozenset(normalised)
    out: list[Violation] = []
    if MODEL_NEW not in normalised:
        out.append(
            Violation(
                rules.MISSING_MODELNEW,
                MODEL_NEW,
                0,
                "the solution has no model_new.py; write model_new.py defining class ModelNew.",
            )
        )
    declared: set[str] = set()  # functions the solution's C++ sources declare, in any file
    for path, text in normalised.items():
        if path.lower().endswith(CPP_SUFFIXES):
            declared |= declared_functions(strip_cpp(text)[1])
    for path in sorted(normalised, key=lambda p: (p != MODEL_NEW, p)):
        text = normalised[path]
        lower = path.lower()
        if lower.endswith(".py"):
            if path == MODEL_NEW:
                out += check_model_new(text, filename=path, single_file=single_file)
                if single_file:
                    out += dedupe(_inline_violations(text, filename=path, device=device))
            else:
                out.append(
                    Violation(
                        rules.FORBIDDEN_IMPORT,
                        path,
                        0,
                        f"{path} is an extra Python file; the only Python a solution may "
                        f"contain is {MODEL_NEW}, so move the code there.",
                    )
                )
        elif lower.endswith(CPP_SUFFIXES):
            out += check_cpp_source(
                text,
                filename=path,
                device=device,
                single_file=single_file,
                known_files=known,
                declared=declared,
            )
    return out
