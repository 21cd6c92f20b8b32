"""Executing a task's code as a module (trusted processes only)."""

from __future__ import annotations

import sys
import traceback
import types

from cuda_agent.tasks.model import REQUIRED_NAMES, Task, TaskError


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
