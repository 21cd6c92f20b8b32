"""`cuda-agent rl prepare`: tasks to verl's RL parquet files, agentic and single-turn.

    TASKS (file, folder, Ops-6K or datagen rows) -> valid tasks, duplicates dropped
    -> split by a seeded hash of each task id (the same task always lands on the same side)
    -> OUT/agentic/{train,val}.parquet       the episode's first messages, loop `cuda_agent`
    -> OUT/single_turn/{train,val}.parquet   one-shot prompts for a single-file solution
    -> OUT/manifest.json                     counts per split, task ids, what was skipped

Every row carries the columns verl's `RLHFDataset` and reward managers read: `prompt` (a
list of {role, content}), `agent_name`, `data_source`, `extra_info` (the task, device,
index and split) and `reward_model` ({"style": "rule", "ground_truth": task id}).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda_agent.agent.loop import initial_messages
from cuda_agent.files import atomic_write
from cuda_agent.tasks import Task, load_tasks_report
from cuda_agent.tasks.loaders import import_pyarrow
from cuda_agent.workspace import DEVICES, skill_text

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
AGENTIC = "agentic"
SINGLE_TURN = "single_turn"
SPLITS = ("train", "val")
# the agent-loop names verl picks per row (ours in agent_loops.yaml, verl's own single-turn loop)
AGENT_LOOPS = {AGENTIC: "cuda_agent", SINGLE_TURN: "single_turn_agent"}
EXTRA_INFO_KEYS = ("task_id", "task_name", "code", "source", "device", "index", "split")


@dataclass(frozen=True)
class PreparedTask:
    task: Task
    index: int  # position among the usable tasks, in load order
    data_source: str


# --------------------------------------------------------------------------- prompts


_RULES = """\
## Rules (checked by the evaluator; a broken rule fails the solution)

- Answer with one complete file, `model_new.py`, in a single ```python block. It builds its
  kernels with `torch.utils.cpp_extension.load_inline` ({sources}; `functions=[...]`).
- It defines `class ModelNew(nn.Module)` with the same constructor arguments as `Model` and
  the same parameters and buffers (names and shapes): the evaluator loads `Model`'s
  `state_dict()` into it.
- In Python, only tensor creation (`torch.empty`, ...), tensor properties, views and calls
  into the extension are allowed: no torch compute (`torch.matmul`, `x + y`,
  `torch.nn.functional`, calling `nn` layers in `forward`), no `try`/`except`, no threads,
  no other imports.
- In C++, no `torch::`/`at::` compute operators; allocation (`torch::empty`,
  `torch::empty_like`) and tensor metadata are fine.
- {libraries}
- Outputs must be new tensors computed from the inputs, within atol = rtol = 1e-2 of
  `Model`'s; do not modify the inputs.
"""

_DEVICE_TEXT = {
    "cuda": {
        "language": "CUDA C++", "target": "CUDA kernels",
        "sources": "cpp_sources: declarations, cuda_sources: kernels and wrappers",
        "libraries": "No third-party libraries except cuBLAS (GEMM) and cuDNN (convolution);\n"
                     "  launch work on the current stream (`c10::cuda::getCurrentCUDAStream()`).",
    },
    "cpu": {
        "language": "C++", "target": "C++ CPU kernels",
        "sources": "cpp_sources only, no CUDA on this device",
        "libraries": "OpenMP (`#pragma omp parallel for`) and SIMD intrinsics are allowed;\n"
                     "  no BLAS, MKL or oneDNN.",
    },
}


def _single_turn_system(device: str) -> str:
    text = _DEVICE_TEXT[device]
    return (f"You are an expert in PyTorch and high-performance {text['language']}. You rewrite "
            f"a PyTorch `Model` as custom {text['target']} so that it runs faster than both "
            "eager PyTorch and torch.compile.\n\n"
            + _RULES.format(sources=text["sources"], libraries=text["libraries"]))


def _single_turn_user(task: Task, device: str) -> str:
    return (f"Task `{task.name}`: make this PyTorch model faster with custom "
            f"{_DEVICE_TEXT[device]['target']}.\n\n```python\n{task.code.rstrip()}\n```\n\n"
            "Reply with the complete `model_new.py` (imports, the `load_inline` call and "
            "`class ModelNew`) in one ```python block.\n")


def single_turn_messages(task: Task, device: str) -> list[dict[str, Any]]:
    """The one-shot prompt of the single-turn stage: a whole single-file solution in reply."""
    return [{"role": "system", "content": _single_turn_system(device)},
            {"role": "user", "content": _single_turn_user(task, device)}]


def agentic_messages(task: Task, device: str) -> list[dict[str, Any]]:
    """The first messages of an agentic episode, exactly as `cuda-agent optimize` starts one."""
    return initial_messages(task, device, skill_text(task, device))


# --------------------------------------------------------------------------- split


def split_rank(task_id: str, seed: int) -> str:
    """The task's place in the seeded order that decides the split (smallest go to val)."""
    return hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()


def val_count(n: int, val_fraction: float) -> int:
    """How many of `n` tasks go to val: at least one when there are two or more (and the
    fraction is not 0), never all of them."""
    if n < 2 or val_fraction == 0:
        return 0
    return min(max(1, round(n * val_fraction)), n - 1)


def split_ids(task_ids: list[str], val_fraction: float, seed: int) -> set[str]:
    """The ids that go to val; depends only on the set of ids, the fraction and the seed."""
    unique = sorted(set(task_ids), key=lambda t: (split_rank(t, seed), t))
    return set(unique[: val_count(len(unique), val_fraction)])


# --------------------------------------------------------------------------- rows


def _source_kind(path: Path) -> str:
    if path.is_dir():
        return "folder"
    return "file" if path.suffix.lower() == ".py" else path.suffix.lower().lstrip(".")


def _data_source(task: Task, default: str) -> str:
    value = task.meta.get("data_source")
    return value.strip() if isinstance(value, str) and value.strip() else default


def _row(item: PreparedTask, kind: str, device: str, split: str) -> dict[str, Any]:
    task = item.task
    build = agentic_messages if kind == AGENTIC else single_turn_messages
    messages = build(task, device)
    return {
        "prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in messages],
        "agent_name": AGENT_LOOPS[kind],
        "data_source": item.data_source,
        "extra_info": {"task_id": task.id, "task_name": task.name, "code": task.code,
                       "source": task.source, "device": device, "index": item.index,
                       "split": split},
        "reward_model": {"style": "rule", "ground_truth": task.id},
    }


def parquet_schema() -> Any:
    """The columns of every file `prepare` writes (one fixed schema, so that empty splits and
    every row read back with the same keys)."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    extra = pa.struct([(k, pa.int64() if k == "index" else pa.string()) for k in EXTRA_INFO_KEYS])
    return pa.schema([
        ("prompt", pa.list_(message)),
        ("agent_name", pa.string()),
        ("data_source", pa.string()),
        ("extra_info", extra),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ])


def _write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    import_pyarrow(path, "writing")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=parquet_schema())
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda fh: pq.write_table(table, fh))


# --------------------------------------------------------------------------- prepare


def usable_tasks(tasks_path: str | Path,
                 max_tasks: int | None = None) -> tuple[list[PreparedTask], dict[str, Any]]:
    """The valid, distinct tasks of `tasks_path` (first `max_tasks` in load order), and what was
    skipped: {"invalid": n, "duplicate": n, "rows": [{"source", "reason"}, ...]}."""
    path = Path(tasks_path)
    tasks, invalid = load_tasks_report(path, skip_invalid=True)
    default_source = f"cuda-agent/{_source_kind(path)}"
    skipped: dict[str, Any] = {"invalid": len(invalid), "duplicate": 0,
                               "rows": [{"source": s, "reason": r} for s, r in invalid]}
    seen: set[str] = set()
    usable: list[PreparedTask] = []
    for task in tasks:
        if max_tasks is not None and len(usable) >= max_tasks:
            break
        if task.id in seen:
            skipped["duplicate"] += 1
            why = f"the same code as an earlier task ({task.id})"
            skipped["rows"].append({"source": task.source, "reason": why})
            continue
        seen.add(task.id)
        usable.append(PreparedTask(task=task, index=len(usable),
                                   data_source=_data_source(task, default_source)))
    return usable, skipped


def prepare(tasks_path: str | Path, out_dir: str | Path, *, device: str = "cuda",
            val_fraction: float = 0.05, seed: int = 0,
            max_tasks: int | None = None) -> dict[str, Any]:
    """Write the agentic and single-turn RL datasets of `tasks_path` under `out_dir`; returns
    the manifest (also written to `out_dir/manifest.json`): counts, paths and task ids per split,
    and the skipped rows. Raises ValueError (TaskError) when nothing is usable."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use {' or '.join(DEVICES)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"the validation fraction must be in [0, 1), got {val_fraction:g}")
    if max_tasks is not None and max_tasks < 1:
        raise ValueError(f"--max-tasks must be at least 1, got {max_tasks}")
    usable, skipped = usable_tasks(tasks_path, max_tasks)
    if not usable:  # (the loader raises first when no row is valid; kept for safety)
        raise ValueError(f"no usable task in {tasks_path}")
    val_ids = split_ids([p.task.id for p in usable], val_fraction, seed)
    by_split = {"train": [p for p in usable if p.task.id not in val_ids],
                "val": [p for p in usable if p.task.id in val_ids]}
    out = Path(out_dir)
    files: dict[str, dict[str, str]] = {}
    for kind in (AGENTIC, SINGLE_TURN):
        files[kind] = {}
        for split in SPLITS:
            rows = [_row(p, kind, device, split) for p in by_split[split]]
            files[kind][split] = str(_write_rows(rows, out / kind / f"{split}.parquet"))
    manifest = {
        "version": MANIFEST_VERSION,
        "tasks": str(tasks_path),
        "device": device,
        "seed": seed,
        "val_fraction": val_fraction,
        "max_tasks": max_tasks,
        "counts": {split: len(by_split[split]) for split in SPLITS},
        "task_ids": {split: [p.task.id for p in by_split[split]] for split in SPLITS},
        "files": files,
        "agent_names": dict(AGENT_LOOPS),
        "skipped": skipped,
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


# --------------------------------------------------------------------------- command line


def cmd_prepare(args: argparse.Namespace) -> int:
    manifest = prepare(args.tasks, args.out, device=args.device, val_fraction=args.val_fraction,
                       seed=args.seed, max_tasks=args.max_tasks)
    counts, skipped = manifest["counts"], manifest["skipped"]
    print(f"{counts['train']} train and {counts['val']} val tasks for {args.device} in {args.out} "
          f"(agentic/ and single_turn/; {MANIFEST})")
    if skipped["invalid"] or skipped["duplicate"]:
        print(f"skipped {skipped['invalid']} invalid and {skipped['duplicate']} duplicate task(s); "
              f"reasons in {MANIFEST}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare",
                              help="tasks to verl's RL parquet (agentic and single-turn sets)")
    p.add_argument("tasks",
                   help="a task file, a folder of them, or a .jsonl/.json/.parquet dataset")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--device", choices=list(DEVICES), default="cuda", help="where kernels will run")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of tasks held out for validation (at least one of two or more)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--max-tasks", type=int, default=None, help="use only the first N usable tasks")
    p.set_defaults(func=cmd_prepare)
