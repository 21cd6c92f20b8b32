"""The agent's tools and its sandboxed shell, without a model."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cuda_agent.agent.shell import ShellSession
from cuda_agent.agent.tools import ToolError, Tools, parse_call, truncate
from cuda_agent.tasks import load_task_file
from cuda_agent.workspace import LOCKED, create_workspace

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples" / "tasks" / "axpby.py"


@pytest.fixture
def tools(tmp_path: Path):  # type: ignore[no-untyped-def]
    ws = create_workspace(load_task_file(TASK), tmp_path / "ws", "cpu")
    control = tmp_path / "control"
    control.mkdir()
    control.chmod(0o755)
    locked = [(ws / n, str(ws / n)) for n in LOCKED]
    shell = ShellSession(ws, control, readonly=[*locked, (control, str(control))], env={})
    t = Tools(ws, shell, command_timeout_s=20)
    yield t
    shell.close()


def call(t: Tools, name: str, **args):  # type: ignore[no-untyped-def]
    return asyncio.run(t.call(name, parse_call(name, __import__("json").dumps(args))))


def test_shell_state_persists_and_exit_codes_are_reported(tools: Tools) -> None:
    assert call(tools, "bash", command="mkdir -p sub && cd sub && export X=42").ok
    out = call(tools, "bash", command="pwd; echo $X")
    assert out.output.endswith("/ws/sub\n42") and out.ok
    bad = call(tools, "bash", command="echo to-stderr >&2; false")
    assert "to-stderr" in bad.output and "[exit code 1]" in bad.output and not bad.ok
    syntax = call(tools, "bash", command="echo 'unbalanced")  # a syntax error, not a hang
    assert "unexpected EOF" in syntax.output or "syntax error" in syntax.output
    assert call(tools, "bash", command="cat").output == "(no output)"  # stdin is /dev/null, not the next command


def test_timeout_kills_the_shell_and_the_next_command_gets_a_new_one(tools: Tools) -> None:
    call(tools, "bash", command="cd kernels")
    out = call(tools, "bash", command="echo started; sleep 60", timeout=2)
    assert "started" in out.output and "timed out after 2 s" in out.output and out.meta["timed_out"]
    again = call(tools, "bash", command="pwd")
    assert again.ok and again.output.splitlines()[0].endswith("/ws")  # back in the workspace root
    assert "ran in a new one" in again.output


def test_background_jobs_can_be_read_and_killed(tools: Tools) -> None:
    call(tools, "bash", command="(for i in 1 2 3; do echo tick $i; sleep 0.2; done; sleep 100) > bg.log 2>&1 &")
    out = call(tools, "bash", command="sleep 1; cat bg.log; jobs")
    assert "tick 3" in out.output and "Running" in out.output
    gone = call(tools, "bash", command="kill %1; wait 2>/dev/null; jobs; ps -eo args | grep -c '^sleep 100' || true")
    assert "Running" not in gone.output and gone.output.strip().endswith("0")


def test_locked_files_network_and_outside_paths_are_refused(tools: Tools) -> None:
    for name, args in [("write_file", {"path": "model.py", "content": "x"}),
                       ("edit_file", {"path": "binding.cpp", "old_string": "PYBIND11", "new_string": "X"}),
                       ("write_file", {"path": "utils/compile.sh", "content": "x"})]:
        r = call(tools, name, **args)
        assert not r.ok and "locked" in r.output
    r = call(tools, "bash", command="echo hacked >> model.py; echo x > utils/new.py")
    assert "Read-only file system" in r.output
    assert "hacked" not in (tools.root / "model.py").read_text()
    net = call(tools, "bash", command="python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"")
    assert not net.ok and ("unreachable" in net.output or "Errno" in net.output)
    assert "outside the workspace" in call(tools, "read_file", path="/etc/passwd").output
    call(tools, "bash", command="ln -s /etc/passwd escape")
    assert "outside the workspace" in call(tools, "read_file", path="escape").output
    assert "outside the workspace" in call(tools, "write_file", path="../x.txt", content="x").output


SECRET = "ROOT-ONLY-5b1e"


def test_the_file_tools_never_follow_a_link_even_one_made_after_their_check(
        tools: Tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path checks see the tree as it was; the agent's shell (a background job, say)
    can swap a file or a folder for a link before the tool opens it. Nothing behind the
    link is read, quoted or written."""
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "s.txt").write_text(SECRET)
    monkeypatch.setattr(os.path, "realpath", os.path.normpath)  # the check before the swap
    call(tools, "bash", command=f"ln -s {secret}/s.txt kernels/k.cu; ln -s {secret} kernels/sub")
    for name, args in [("read_file", {"path": "kernels/k.cu"}), ("grep", {"pattern": "ROOT"}),
                       ("grep", {"pattern": "ROOT", "path": "kernels/sub"}),
                       ("edit_file", {"path": "kernels/k.cu", "old_string": "ROOT", "new_string": "X"}),
                       ("write_file", {"path": "kernels/k.cu", "content": "x"}),
                       ("write_file", {"path": "kernels/sub/new.cu", "content": "x"})]:
        r = call(tools, name, **args)
        assert SECRET not in r.output, (name, r.output)
        assert not r.ok or name == "grep", (name, r.output)
    assert "symbolic link" in call(tools, "read_file", path="kernels/k.cu").output
    assert (secret / "s.txt").read_text() == SECRET and sorted(os.listdir(secret)) == ["s.txt"]


def test_file_tools(tools: Tools) -> None:
    assert "Created kernels/a.cu (3 lines)" in call(tools, "write_file", path="kernels/a.cu", content="one\ntwo\ntwo\n").output
    assert "   2\ttwo" in call(tools, "read_file", path="kernels/a.cu", offset=2, limit=1).output
    assert "occurs 2 times" in call(tools, "edit_file", path="kernels/a.cu", old_string="two", new_string="2").output
    multi = call(tools, "edit_file", path="kernels/a.cu", edits=[
        {"old_string": "one", "new_string": "1"}, {"old_string": "two", "new_string": "2", "replace_all": True}])
    assert "3 replacement(s)" in multi.output and (tools.root / "kernels/a.cu").read_text() == "1\n2\n2\n"
    atomic = call(tools, "edit_file", path="kernels/a.cu", edits=[
        {"old_string": "1", "new_string": "one"}, {"old_string": "absent", "new_string": "x"}])
    assert "edit 2" in atomic.output and (tools.root / "kernels/a.cu").read_text() == "1\n2\n2\n"
    assert call(tools, "glob", pattern="kernels/*.cu").output == "kernels/a.cu"
    assert "kernels/a.cu:2: 2" in call(tools, "grep", pattern="^2$", glob="*.cu").output
    # the shell can change what the file tools wrote
    assert call(tools, "bash", command="echo 3 >> kernels/a.cu && tail -1 kernels/a.cu").output == "3"


def test_malformed_calls_and_truncation() -> None:
    with pytest.raises(ToolError, match="not valid JSON"):
        parse_call("bash", "{oops")
    with pytest.raises(ToolError, match="no tool named"):
        parse_call("python", "{}")
    with pytest.raises(ToolError, match="needs command"):
        parse_call("bash", "{}")
    with pytest.raises(ToolError, match="has no argument"):
        parse_call("read_file", '{"path": "a", "mode": "x"}')
    long = "x" * 50_000
    cut = truncate(long, 1000)
    assert len(cut) < 1100 and "49000 characters cut" in cut
