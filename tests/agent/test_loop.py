"""The agent loop end to end: the real `openai` client against a local HTTP server speaking
chat completions with scripted replies, the real sandboxed tools, the real CPU evaluator."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cuda_agent.agent import AgentConfig, OpenAIClient, OpenAIConfig, run_episode
from cuda_agent.agent.loop import CONTROL_PREFIX
from cuda_agent.agent.scripted_server import ScriptedServer, from_turns
from cuda_agent.agent.trajectory import read_events
from cuda_agent.tasks import load_task_file

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples" / "tasks" / "axpby.py"
SOL = REPO / "examples" / "solutions" / "axpby_cpu"
KERNEL = (SOL / "kernels" / "axpby.cpp").read_text()
BINDING = (SOL / "kernels" / "axpby_binding.cpp").read_text()
MODEL_NEW = (SOL / "model_new.py").read_text()


def bash(cmd: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "bash", "arguments": {"command": cmd}}]}


def write(path: str, content: str) -> dict[str, Any]:
    return {"name": "write_file", "arguments": {"path": path, "content": content}}


FINISH = {"content": "Done.", "tool_calls": [{"name": "finish", "arguments": {"summary": "done"}}]}
WRITE_SOLUTION = {"content": "Writing the kernel.", "tool_calls": [
    write("kernels/axpby.cpp", KERNEL), write("kernels/axpby_binding.cpp", BINDING), write("model_new.py", MODEL_NEW)]}


def episode(tmp_path: Path, server: ScriptedServer, **cfg: Any):  # type: ignore[no-untyped-def]
    cfg.setdefault("final_evaluation", False)
    client = OpenAIClient(OpenAIConfig(model="scripted", base_url=server.base_url, backoff_s=0.05))
    summary = asyncio.run(run_episode(load_task_file(TASK), client, tmp_path / "run", device="cpu",
                                      config=AgentConfig(**cfg)))
    return summary, read_events(tmp_path / "run" / "trajectory.jsonl"), client


def tool_outputs(events: list[dict[str, Any]]) -> list[str]:
    return [e["message"]["content"] for e in events if e["type"] == "message" and e["message"]["role"] == "tool"]


def test_episode_writes_compiles_verifies_profiles_and_finishes(tmp_path: Path) -> None:
    turns = [bash("ls && head -3 model.py"), WRITE_SOLUTION, bash("bash utils/compile.sh"),
             bash("python3 -m utils.verification"), bash("python3 -m utils.profiling"), FINISH]
    with ScriptedServer(from_turns(turns)) as srv:
        s, events, _ = episode(tmp_path, srv)  # the final evaluation is tested through the CLI demo
    assert s.reason == "finish" and s.turns == 6 and s.correct and s.reward >= 1.0 and s.best_from == "turn 5"
    assert s.speedup_vs_compile and s.prompt_tokens > 0 and s.completion_tokens > 0
    outs = tool_outputs(events)
    assert "Compile success" in outs[4] and "[PASS] verify success" in outs[5] and "Speedup vs torch.compile" in outs[6]
    evals = [(e["command"], e["source"]) for e in events if e["type"] == "evaluation"]
    assert evals == [("compile", "agent"), ("verification", "agent"), ("profiling", "agent")]
    # the service's start-up work, recorded apart from the agent's evaluations
    pre = [e for e in events if e["type"] == "prefetch"]
    assert len(pre) == 1 and pre[0]["baselines"] in ("measured", "cached"), pre
    assert pre[0]["headers"] == "cached" or pre[0]["headers"].startswith("built: "), pre
    best = tmp_path / "run" / "best"
    assert (best / "kernels" / "axpby.cpp").read_text() == KERNEL and (best / "model_new.py").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward"] == s.reward and events[-1]["type"] == "end"
    # what the model saw is what the server was sent: the last request holds every tool result
    last = srv.requests[-1]["messages"]
    assert [m["content"] for m in last if m["role"] == "tool"] == outs[:-1]


def test_broken_kernel_is_fixed_after_reading_the_compiler_error(tmp_path: Path) -> None:
    seen: list[str] = []

    def policy(req: dict[str, Any]) -> dict[str, Any]:
        msgs = req["messages"]
        k = sum(1 for m in msgs if m["role"] == "assistant")
        last = msgs[-1]["content"] if msgs[-1]["role"] == "tool" else ""
        if k == 0:
            return {"tool_calls": [write("kernels/axpby.cpp", KERNEL.replace("alpha * a[i]", "alpha * a_typo[i]")),
                                   write("kernels/axpby_binding.cpp", BINDING), write("model_new.py", MODEL_NEW)]}
        if k == 1:
            return bash("bash utils/compile.sh")
        if k == 2:
            seen.append(last)
            if "kernels/axpby.cpp:" in last and "a_typo" in last:
                return {"tool_calls": [{"name": "edit_file", "arguments": {
                    "path": "kernels/axpby.cpp", "old_string": "a_typo[i]", "new_string": "a[i]",
                    "replace_all": True}}]}
            return FINISH
        if k == 3:
            return bash("bash utils/compile.sh && python3 -m utils.verification")
        return FINISH

    with ScriptedServer(policy) as srv:
        s, events, _ = episode(tmp_path, srv, score_every_build=True)
    assert "Compilation failed" in seen[0] and "a_typo" in seen[0] and len(seen[0]) < 4000  # trimmed, actionable
    outs = tool_outputs(events)
    assert "Edited kernels/axpby.cpp" in outs[4] and "[PASS] verify success" in outs[5]
    assert s.reason == "finish" and s.turns == 5
    compiles = [e["rc"] for e in events if e["type"] == "evaluation" and e["command"] == "compile"]
    assert compiles == [1, 0]
    # --score-every-build: the state that compiled was profiled, and it is the best one kept
    scored = [e for e in events if e["type"] == "evaluation" and e["source"] == "score"]
    assert len(scored) == 1 and scored[0]["result"]["correct"] and s.correct and s.best_from == "turn 4"
    assert "a_typo" not in (tmp_path / "run" / "best" / "kernels" / "axpby.cpp").read_text()


def test_locked_files_and_the_network_are_refused(tmp_path: Path) -> None:
    turns = [{"tool_calls": [write("model.py", "class Model: pass\n"),
                             {"name": "edit_file", "arguments": {"path": "utils/compile.sh", "old_string": "exec",
                                                                 "new_string": "true #"}}]},
             bash("echo 'x = 1' > model.py; rm -f binding.cpp; ls binding.cpp"),
             bash("python3 -c \"import urllib.request as u; u.urlopen('http://pypi.org', timeout=5)\""),
             FINISH]
    with ScriptedServer(from_turns(turns)) as srv:
        s, events, _ = episode(tmp_path, srv)
    outs = tool_outputs(events)
    assert outs[0].startswith("Error: model.py is locked") and "utils/compile.sh is locked" in outs[1]
    assert "Read-only file system" in outs[2] and "binding.cpp" in outs[2]
    assert "URLError" in outs[3] or "unreachable" in outs[3] or "resolution" in outs[3]
    ws = tmp_path / "run" / "workspace"
    assert "class Model(nn.Module)" in (ws / "model.py").read_text() and (ws / "binding.cpp").is_file()
    assert s.reason == "finish"


def test_malformed_tool_calls_get_a_corrective_message_then_end_the_episode(tmp_path: Path) -> None:
    turns = [{"tool_calls": [{"name": "bash", "arguments": "{\"command\": "}]},
             {"tool_calls": [{"name": "run_python", "arguments": {"code": "1"}}]},
             bash("echo fine"),  # a good call resets the count
             {"tool_calls": [{"name": "read_file", "arguments": {}}]},
             {"tool_calls": [{"name": "bash", "arguments": "[1, 2]"}]},
             {"tool_calls": [{"name": "edit_file", "arguments": {"path": "x", "bogus": 1}}]},
             FINISH]
    with ScriptedServer(from_turns(turns)) as srv:
        s, events, _ = episode(tmp_path, srv, max_malformed=3)
    outs = tool_outputs(events)
    assert "not valid JSON" in outs[0] and "no tool named 'run_python'" in outs[1] and outs[2] == "fine"
    assert "read_file needs path" in outs[3] and "must be a JSON object" in outs[4]
    assert s.reason == "malformed-tool-calls" and s.turns == 6
    # the corrective message reached the model with the next request
    assert any("malformed tool call" in (m.get("content") or "") for m in srv.requests[1]["messages"])


def test_turn_limit_and_context_budget(tmp_path: Path) -> None:
    loud = bash("python3 -c \"print('y' * 6000)\"")
    with ScriptedServer(from_turns([loud] * 10)) as srv:
        s, events, _ = episode(tmp_path / "turns", srv, max_turns=3)
    assert s.reason == "max-turns" and s.turns == 3 and len(srv.requests) == 3

    with ScriptedServer(from_turns([loud] * 10)) as srv:
        s, events, _ = episode(tmp_path / "context", srv, context_tokens=6000, keep_recent_messages=2, max_turns=8)
    elided = [e for e in events if e["type"] == "elide"]
    assert elided and s.reason == "max-turns"
    # old outputs went to the server elided; the latest outputs and the task never were
    last = srv.requests[-1]["messages"]
    assert last[1]["role"] == "user" and "axpby" in last[1]["content"]
    assert "[output elided to save context" in last[3]["content"] and last[-1]["content"].startswith("yyyy")
    assert all(r.get("max_tokens", 1) <= 6000 for r in srv.requests)

    with ScriptedServer(from_turns([loud])) as srv:
        s, _, _ = episode(tmp_path / "tiny", srv, context_tokens=500)
    assert s.reason == "context-full" and s.turns == 0 and not srv.requests


def test_transient_server_failures_are_retried(tmp_path: Path) -> None:
    with ScriptedServer(from_turns([bash("echo up"), FINISH]), fail_first=3) as srv:
        s, events, client = episode(tmp_path, srv)
    assert s.reason == "finish" and srv.failures == 3 and client.retries_used == 3
    assert tool_outputs(events)[0] == "up"
    with ScriptedServer(from_turns([bash("echo up")]), fail_first=100) as srv:
        s, events, client = episode(tmp_path / "down", srv)
    assert s.reason == "model-error" and any(e["type"] == "model" and "error" in e for e in events)


def test_resume_after_a_kill_continues_the_episode(tmp_path: Path) -> None:
    out = tmp_path / "run"
    gate = out / "workspace" / "let-it-finish"  # the sandboxed shell sees only the workspace
    turns = [bash("echo one > one.txt && echo one"), bash("echo two"),
             bash("if [ -e let-it-finish ]; then echo three; else sleep 120; fi"), bash("cat one.txt"), FINISH]
    with ScriptedServer(from_turns(turns)) as srv:
        script = (f"import asyncio\nfrom cuda_agent.agent import *\nfrom cuda_agent.tasks import load_task_file\n"
                  f"c = OpenAIClient(OpenAIConfig(model='scripted', base_url={srv.base_url!r}))\n"
                  f"asyncio.run(run_episode(load_task_file({str(TASK)!r}), c, {str(out)!r}, device='cpu', "
                  f"config=AgentConfig(final_evaluation=False)))\n")
        proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        traj = out / "trajectory.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline:  # kill it while the third command runs
            if traj.exists() and sum(1 for e in read_events(traj) if e["type"] == "tool") == 2 and \
                    sum(1 for e in read_events(traj) if e["type"] == "model") == 3:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert not any(e["type"] == "end" for e in read_events(traj))
        left = list(Path(tempfile.gettempdir()).glob(f"{CONTROL_PREFIX}{proc.pid}-*"))
        assert len(left) == 1  # the killed episode could not remove its socket's folder
        gate.write_text("go")
        client = OpenAIClient(OpenAIConfig(model="scripted", base_url=srv.base_url))
        s = asyncio.run(run_episode(load_task_file(TASK), client, out, device="cpu",
                                    config=AgentConfig(final_evaluation=False), resume=True))
    events = read_events(traj)
    assert s.reason == "finish" and any(e["type"] == "resume" and e["dropped"] == 1 for e in events)
    assert not left[0].exists()  # the next episode removed it, its process being gone
    outs = tool_outputs(events)
    assert outs == ["one", "two", "three", "one", "Episode finished; the workspace's solution will be evaluated."]
    # the conversation sent after the resume is the one before the kill, without the turn in flight
    after = srv.requests[-2]["messages"]
    assert [m["content"] for m in after if m["role"] == "tool"] == ["one", "two", "three"]
