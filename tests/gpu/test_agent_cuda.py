"""The agent loop on a real GPU: a replayed episode writes the CUDA axpby solution through
the sandboxed tools, compiles, verifies and profiles it, and its shell sees one GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cuda_agent.agent import AgentConfig, ReplayClient, run_episode
from cuda_agent.agent.trajectory import read_events
from cuda_agent.tasks import load_task_file

from . import cases_cuda as C

pytestmark = pytest.mark.gpu


def test_replayed_cuda_episode(tmp_path: Path) -> None:
    writes = [{"name": "write_file", "arguments": {"path": rel, "content": text}} for rel, text in C.AXPBY.items()]
    turns = [
        {"tool_calls": [{"name": "bash", "arguments": {
            "command": "python3 -c 'import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(0))'"}}]},
        {"tool_calls": writes},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "bash utils/compile.sh && python3 -m utils.profiling"}}]},
        {"tool_calls": [{"name": "finish", "arguments": {"summary": "axpby"}}]},
    ]
    s = asyncio.run(run_episode(load_task_file(C.AXPBY_TASK), ReplayClient(turns), tmp_path / "run", device="cuda",
                                config=AgentConfig(gpu_index=0)))
    events = read_events(tmp_path / "run" / "trajectory.jsonl")
    outs = [e["message"]["content"] for e in events if e["type"] == "message" and e["message"]["role"] == "tool"]
    print("\n".join(o[:400] for o in outs))
    print("profiling, whole:\n" + outs[-2][:4000])  # flags and any torch.compile failure
    print(s.to_dict())
    assert outs[0].startswith("1 ")  # exactly the assigned GPU
    assert "Compile success" in outs[-2] and "Speedup vs torch.compile" in outs[-2]
    assert s.reason == "finish" and s.correct and s.reward >= 1.0
