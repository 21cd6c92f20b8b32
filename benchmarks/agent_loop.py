"""Per-turn overhead of the agent loop itself, and many concurrent episodes on one machine.

    python benchmarks/agent_loop.py [--episodes 32] [--turns 20]

Runs N episodes at once in one process against the scripted chat-completions server (real
`openai` client over HTTP, real sandboxed shell and file tools, CPU workspace, no final
evaluation). Each turn is one cheap tool call (bash, read_file, write_file, grep in
turn). Overhead per turn = episode wall time minus time in model calls minus time in
tools, divided by turns: the loop's own cost (context bookkeeping, trajectory writes with
fsync, tool-call parsing). Also reports errors (episodes that did not end by `finish`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def script(turns: int) -> list[dict]:
    cycle = [
        {"name": "bash", "arguments": {"command": "echo $((RANDOM % 100)) >> notes.txt && wc -l < notes.txt"}},
        {"name": "read_file", "arguments": {"path": "model.py"}},
        {"name": "write_file", "arguments": {"path": "kernels/scratch.cpp", "content": "// scratch\n" * 20}},
        {"name": "grep", "arguments": {"pattern": "forward", "glob": "*.py"}},
    ]
    out = [{"content": f"step {i}", "tool_calls": [cycle[i % len(cycle)]]} for i in range(turns - 1)]
    out.append({"content": "done", "tool_calls": [{"name": "finish", "arguments": {"summary": "benchmark"}}]})
    return out


async def main_async(args: argparse.Namespace) -> int:
    from cuda_agent.agent import AgentConfig, OpenAIClient, OpenAIConfig, run_episode
    from cuda_agent.agent.scripted_server import ScriptedServer, from_turns
    from cuda_agent.agent.trajectory import read_events
    from cuda_agent.tasks import load_task_file

    task = load_task_file(REPO / "examples" / "tasks" / "axpby.py")
    root = Path(tempfile.mkdtemp(prefix="agent-loop-bench-"))
    cfg = AgentConfig(final_evaluation=False, max_turns=args.turns + 5)
    with ScriptedServer(from_turns(script(args.turns))) as srv:
        clients = [OpenAIClient(OpenAIConfig(model="scripted", base_url=srv.base_url)) for _ in range(args.episodes)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run_episode(task, c, root / f"ep{i}", device="cpu", config=cfg)
                                         for i, c in enumerate(clients)), return_exceptions=True)
        wall = time.perf_counter() - t0
    overheads, model_s, tool_s, errors = [], [], [], []
    for i, r in enumerate(results):
        if isinstance(r, BaseException) or r.reason != "finish":
            errors.append(f"episode {i}: {r!r}"[:300])
            continue
        events = read_events(root / f"ep{i}" / "trajectory.jsonl")
        m = sum(e.get("latency_s", 0.0) for e in events if e["type"] == "model")
        t = sum(e.get("seconds", 0.0) for e in events if e["type"] == "tool")
        model_s.append(m / r.turns)
        tool_s.append(t / r.turns)
        overheads.append((r.seconds - m - t) / r.turns)
    print(f"{args.episodes} concurrent episodes x {args.turns} turns in {wall:.1f} s "
          f"({args.episodes * args.turns / wall:.1f} turns/s overall); errors: {len(errors)}")
    for e in errors[:5]:
        print("  ", e)
    if overheads:
        def row(name: str, xs: list[float]) -> None:
            print(f"{name:34s} median {statistics.median(xs) * 1e3:8.2f} ms  max {max(xs) * 1e3:8.2f} ms")
        row("model call per turn (HTTP)", model_s)
        row("tool time per turn", tool_s)
        row("loop overhead per turn", overheads)
    if args.json_out:
        args.json_out.write_text(json.dumps({"episodes": args.episodes, "turns": args.turns, "wall_s": wall,
                                             "errors": errors, "overhead_s": overheads}))
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
