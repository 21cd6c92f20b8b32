"""The agent's workspace: created from a task, with locked files and a trusted record.

The workspace is the agent's to edit; nothing in it is trusted. At creation the task is
also recorded under the cache, keyed by the workspace's real path, so the workspace
commands evaluate against the original task even if `model.py` is changed.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.paths import TEMPLATES, cache_dir, short_hash
from cuda_agent.tasks import Task, task_from_code

LOCKED = ("model.py", "binding.cpp", "binding_registry.h", "utils")
DEVICES = ("cuda", "cpu")


class WorkspaceError(ValueError):
    pass


@dataclass(frozen=True)
class WorkspaceRecord:
    task: Task
    device: str
    path: Path


def _record_dir(path: Path) -> Path:
    return cache_dir("workspaces", short_hash(str(path.resolve())))


def starter_model_new(task: Task) -> str:
    """ModelNew with Model's constructor (so the state_dict matches) and an empty forward."""
    tree = ast.parse(task.code)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    init_src = "    def __init__(self):\n        super().__init__()\n"
    fwd_args = "self, *inputs"
    if model is not None:
        for node in model.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                seg = ast.get_source_segment(task.code, node)
                if seg:
                    init_src = "    " + seg.replace("super(Model, self)", "super()") + "\n"
            if isinstance(node, ast.FunctionDef) and node.name == "forward":
                fwd_args = ast.unparse(node.args)
    return (
        "import torch\nimport torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n"
        f"{init_src}\n"
        f"    def forward({fwd_args}):\n"
        "        # Call your kernels through cuda_extension, e.g. cuda_extension.my_op(x).\n"
        '        raise NotImplementedError("write kernels in kernels/ and call them here")\n'
    )


def skill_text(task: Task, device: str) -> str:
    """The SKILL.md a workspace of `task` on `device` gets (the agent's system prompt)."""
    return (TEMPLATES / f"SKILL.{device}.md").read_text() + \
        f"\n## Your task\n\nOptimize the model in model.py (task {task.name}).\n"


def _lock(path: Path) -> None:
    if path.is_dir():
        for p in path.rglob("*"):
            _lock(p)
        path.chmod(0o555)
    else:
        mode = path.stat().st_mode
        path.chmod(stat.S_IMODE(mode) & ~0o222 | 0o444)


def create_workspace(task: Task, directory: str | Path, device: str = "cuda", *, force: bool = False) -> Path:
    if device not in DEVICES:
        raise WorkspaceError(f"unknown device {device!r}; use cuda or cpu")
    ws = Path(directory)
    if ws.exists() and any(ws.iterdir()):
        if not force:
            raise WorkspaceError(f"{ws} exists and is not empty; pick a new directory or pass --force")
        for name in LOCKED:
            p = ws / name
            if p.exists():
                for q in [p, *p.rglob("*")] if p.is_dir() else [p]:
                    q.chmod(0o755 if q.is_dir() else 0o644)
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "model.py").write_text(task.code)
    for name in ("binding.cpp", "binding_registry.h"):
        shutil.copyfile(TEMPLATES / name, ws / name)
    shutil.copytree(TEMPLATES / "utils", ws / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    os.chmod(ws / "utils" / "compile.sh", 0o755)
    (ws / "SKILL.md").write_text(skill_text(task, device))
    (ws / "kernels").mkdir(exist_ok=True)
    if not (ws / "model_new.py").exists():
        (ws / "model_new.py").write_text(starter_model_new(task))
    for name in LOCKED:
        _lock(ws / name)
    (ws / ".cuda-agent.json").write_text(json.dumps({"device": device, "task": task.name}))
    rec = _record_dir(ws)
    (rec / "task.json").write_text(json.dumps({
        "code": task.code, "name": task.name, "id": task.id, "source": task.source, "device": device,
        "path": str(ws.resolve()),
    }))
    return ws


def remove_workspace(directory: str | Path) -> None:
    """Delete a workspace (its locked files too) and its trusted record; never raises."""
    ws = Path(directory).resolve()
    rec = _record_dir(ws)
    if ws.exists():
        for p in [ws, *ws.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                try:
                    p.chmod(0o755)
                except OSError:
                    pass
        shutil.rmtree(ws, ignore_errors=True)
    shutil.rmtree(rec, ignore_errors=True)


def load_record(directory: str | Path) -> WorkspaceRecord:
    """The trusted record of a workspace; falls back on its model.py if there is none."""
    ws = Path(directory).resolve()
    f = _record_dir(ws) / "task.json"
    if f.exists():
        data = json.loads(f.read_text())
        task = task_from_code(data["code"], name=data["name"], source=data.get("source", "<workspace>"))
        return WorkspaceRecord(task=task, device=data["device"], path=ws)
    model = ws / "model.py"
    if not model.exists():
        raise WorkspaceError(f"{ws} is not a cuda-agent workspace (no model.py); create one with "
                             "`cuda-agent workspace TASK DIR`")
    try:
        device = json.loads((ws / ".cuda-agent.json").read_text()).get("device", "cuda")
    except (OSError, ValueError, AttributeError):
        device = "cuda"
    if device not in DEVICES:
        device = "cuda"
    return WorkspaceRecord(task=task_from_code(model.read_text(), name=ws.name, source=str(model)),
                           device=device, path=ws)
