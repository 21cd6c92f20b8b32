"""Files the candidate or the agent could write are never read through a link: not the
candidate's outputs (the parent, with more rights, would follow a link to the expected
outputs), not a solution's files (the evaluator would quote a file the agent cannot read)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_agent.evaluator.solution import SolutionError, load_solution

from . import cases as C
from .test_evaluate_cpu import run
from .test_trust_boundary import hostile


def test_outputs_linked_to_the_expected_outputs_are_not_read(tmp_path: Path) -> None:
    # native code makes the outputs links to the reference's expected outputs (forge "links")
    res = run(tmp_path, C.AXPBY_TASK, hostile(forge="links"), static_checks=False)
    assert res.status == "runtime_error" and not res.correct and res.reward == -1.0, res.message
    assert "symbolic link" in res.message


SECRET = "ROOT-ONLY-7f3a9c"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    (d / "model_new.py").write_text(f"# {SECRET}\nimport torch\n")
    (d / "k.cu").write_text(f"// {SECRET}\n")
    os.chmod(d / "k.cu", 0o600)
    return d


def linked_solutions(tmp_path: Path, secret: Path) -> dict[str, Path]:
    out = {}
    ws = tmp_path / "model-link"
    (ws / "kernels").mkdir(parents=True)
    (ws / "model_new.py").symlink_to(secret / "model_new.py")
    out["model_new.py"] = ws
    ws = tmp_path / "kernels-link"
    ws.mkdir()
    (ws / "model_new.py").write_text(C.AXPBY_MODEL_NEW)
    (ws / "kernels").symlink_to(secret)
    out["kernels"] = ws
    ws = tmp_path / "kernel-file-link"
    (ws / "kernels" / "sub").mkdir(parents=True)
    (ws / "model_new.py").write_text(C.AXPBY_MODEL_NEW)
    (ws / "kernels" / "sub" / "k.cu").symlink_to(secret / "k.cu")
    out["kernels/sub/k.cu"] = ws
    ws = tmp_path / "fifo"
    (ws / "kernels").mkdir(parents=True)
    (ws / "model_new.py").write_text(C.AXPBY_MODEL_NEW)
    os.mkfifo(ws / "kernels" / "k.cu")  # reading it would wait for a writer
    out["kernels/k.cu"] = ws
    return out


def test_linked_solution_files_are_refused_unread(tmp_path: Path, secret: Path) -> None:
    for name, ws in linked_solutions(tmp_path, secret).items():
        with pytest.raises(SolutionError) as info:
            load_solution(ws)
        assert name in str(info.value) and "symbolic link" in str(info.value) and SECRET not in str(info.value)


def test_the_cli_and_the_workspace_commands_quote_nothing_behind_a_link(tmp_path: Path, secret: Path) -> None:
    ws = linked_solutions(tmp_path, secret)["model_new.py"]
    env = {**os.environ, "PYTHONPATH": str(C.REPO / "src")}
    p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "eval", str(C.AXPBY_TASK), str(ws), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and "symbolic link" in p.stderr and SECRET not in p.stdout + p.stderr
    workspace = tmp_path / "workspace"
    p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "workspace", str(C.AXPBY_TASK), str(workspace),
                        "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    (workspace / "model_new.py").unlink()
    (workspace / "model_new.py").symlink_to(secret / "model_new.py")
    for module in ("utils.verification", "utils.compile"):
        p = subprocess.run([sys.executable, "-m", module], cwd=workspace, capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode != 0 and SECRET not in p.stdout + p.stderr, (module, p.stdout, p.stderr)
        assert "symbolic link" in p.stdout + p.stderr


def test_run_files_are_mapped_read_as_written_and_never_through_a_link(tmp_path: Path) -> None:
    import torch

    from cuda_agent.evaluator.verdict import load_tensors
    from cuda_agent.files import LinkOutside

    data = {"a": torch.randn(1000), "b": [torch.arange(5)]}
    torch.save(data, tmp_path / "zip.pt")
    torch.save(data, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # not mappable: read
    for name in ("zip.pt", "legacy.pt"):
        got = load_tensors(tmp_path, tmp_path / name)
        assert torch.equal(got["a"], data["a"]) and torch.equal(got["b"][0], data["b"][0])
    os.symlink(tmp_path / "zip.pt", tmp_path / "link.pt")
    with pytest.raises(LinkOutside):
        load_tensors(tmp_path, tmp_path / "link.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a tensor file")
    with pytest.raises(Exception):  # noqa: B017  (whatever torch raises; the verdict says the file is unreadable)
        load_tensors(tmp_path, tmp_path / "junk.pt")
