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

from cuda_agent.tasks.importing import import_task_module
from cuda_agent.tasks.loaders import load_task_file, load_tasks, load_tasks_report
from cuda_agent.tasks.model import REQUIRED_NAMES, Task, TaskError, compute_task_id
from cuda_agent.tasks.naming import find_task
from cuda_agent.tasks.validate import task_from_code
from cuda_agent.tasks.writers import write_jsonl, write_parquet

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
