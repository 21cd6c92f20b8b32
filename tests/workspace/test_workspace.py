"""Workspaces: layout, locked files, and the utils commands going through the evaluator."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from cuda_agent.tasks import load_task_file
from cuda_agent.workspace import create_workspace, load_record, starter_model_new

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples" / "tasks" / "axpby.py"
SOLUTION = REPO / "examples" / "solutions" / "axpby_cpu"


def sh(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_layout_and_locks(tmp_path: Path) -> None:
    ws = create_workspace(load_task_file(TASK), tmp_path / "ws", "cpu")
    for name in ("SKILL.md", "model.py", "model_new.py", "binding.cpp", "binding_registry.h",
                 "utils/compile.sh", "utils/verification.py", "utils/profiling.py", "kernels"):
        assert (ws / name).exists(), name
    assert "kernels/NAME.cpp" in (ws / "SKILL.md").read_text() and "OpenMP" in (ws / "SKILL.md").read_text()
    assert not os.access(ws / "model.py", os.W_OK) or os.geteuid() == 0
    assert (ws / "model.py").stat().st_mode & 0o222 == 0
    assert (ws / "utils" / "verification.py").stat().st_mode & 0o222 == 0
    cuda = create_workspace(load_task_file(TASK), tmp_path / "ws_cuda", "cuda")
    assert "kernels/NAME.cu" in (cuda / "SKILL.md").read_text()


def test_starter_model_new_keeps_the_constructor() -> None:
    task = load_task_file(REPO / "tests" / "tasks" / "data" / "76_Linear_ReLU.py")
    src = starter_model_new(task)
    assert "class ModelNew(nn.Module)" in src
    assert "self.linear = nn.Linear(in_features, out_features)" in src
    assert "import cuda_extension" in src
    compile(src, "model_new.py", "exec")


def test_compile_verify_incremental_and_tamper_proof(tmp_path: Path) -> None:
    ws = create_workspace(load_task_file(TASK), tmp_path / "ws", "cpu")
    shutil.copy(SOLUTION / "model_new.py", ws / "model_new.py")
    for f in (SOLUTION / "kernels").iterdir():
        shutil.copy(f, ws / "kernels" / f.name)

    first = sh(["bash", "utils/compile.sh"], ws)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Compile success" in first.stdout
    assert (ws / "cuda_extension.so").exists()

    # Edit one kernel: only that file (and the link) is rebuilt.
    k = ws / "kernels" / "axpby.cpp"
    # A unique edit, so a build cache kept between test runs cannot already hold it.
    k.write_text(k.read_text() + f"\n// tuned {uuid.uuid4().hex}\n")
    second = sh(["bash", "utils/compile.sh"], ws)
    assert second.returncode == 0, second.stdout
    assert "recompiled kernels/axpby.cpp" in second.stdout
    assert "binding.cpp" not in second.stdout.split("recompiled", 1)[1].split("\n")[0]

    ok = sh([sys.executable, "-m", "utils.verification"], ws)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "[PASS] verify success" in ok.stdout

    # Rewriting the locked model.py to match a wrong kernel does not fool verification.
    (ws / "model.py").chmod(0o644)
    (ws / "model.py").write_text(TASK.read_text().replace("self.alpha * a + b", "self.alpha * a - b"))
    k.write_text(k.read_text().replace("alpha * a[i] + b[i]", "alpha * a[i] - b[i]"))
    bad = sh([sys.executable, "-m", "utils.verification"], ws)
    assert bad.returncode == 1
    assert "[FAIL] incorrect" in bad.stdout and "mismatch" in bad.stdout
    assert load_record(ws).task.code == TASK.read_text()

    broken = sh(["bash", "utils/compile.sh"], ws)
    assert broken.returncode == 0  # still compiles; now break it
    k.write_text(k.read_text().replace("int64_t i = 0", "int64_t i = undefined_name"))
    broken = sh(["bash", "utils/compile.sh"], ws)
    assert broken.returncode == 1
    assert "kernels/axpby.cpp:" in broken.stdout and "undefined_name" in broken.stdout

    # Back to the correct kernel: profiling verifies, then times it.
    shutil.copy(SOLUTION / "kernels" / "axpby.cpp", k)
    prof = sh([sys.executable, "-m", "utils.profiling"], ws)
    assert prof.returncode == 0, prof.stdout
    assert "Speedup vs torch.compile" in prof.stdout and "Torch eager" in prof.stdout
