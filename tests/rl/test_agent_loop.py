"""`CudaAgentLoop` inside verl's own worker code (no Ray, no model): a scripted token server,
the real tiny tokenizer and chat template, verl's Continuous Token builder and
post-processing, and our real tools, sandbox and CPU evaluator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from cuda_agent.agent.client import ModelError
from cuda_agent.rl import scripted
from cuda_agent.rl.token_client import TokenClient, parse_tool_calls

REPO = Path(__file__).resolve().parents[2]
TASK = (REPO / "examples" / "tasks" / "axpby.py").read_text()
SOL = REPO / "examples" / "solutions" / "axpby_cpu"
TRAJ_INFO = {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False}


def solve_turns() -> list[str]:
    files = {"kernels/axpby.cpp": (SOL / "kernels" / "axpby.cpp").read_text(),
             "kernels/axpby_binding.cpp": (SOL / "kernels" / "axpby_binding.cpp").read_text(),
             "model_new.py": (SOL / "model_new.py").read_text()}
    return [scripted.hermes({"content": "Writing the kernel.", "tool_calls": [
                {"name": "write_file", "arguments": {"path": p, "content": c}} for p, c in files.items()]}),
            scripted.hermes({"tool_calls": [{"name": "bash", "arguments": {"command": "bash utils/compile.sh"}}]}),
            scripted.hermes({"tool_calls": [{"name": "bash", "arguments": {
                "command": "python3 -m utils.verification"}}]}),
            scripted.hermes({"content": "Done.", "tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]})]


def run_loop(tmp_path: Path, texts: list[str], prompt_length: int = 8192, response_length: int = 16384,
             **settings: Any) -> tuple[Any, Any, scripted.ScriptedServerManager, Any]:
    cfg = scripted.trainer_config({"device": "cpu", "trajectories_dir": str(tmp_path / "traj"), **settings},
                                  prompt_length, response_length)
    server = scripted.ScriptedServerManager(texts)
    w = scripted.worker(cfg, server)

    async def go() -> Any:
        return await w._run_agent_loop({"temperature": 1.0}, TRAJ_INFO, agent_name="cuda_agent",
                                       **scripted.row(TASK, "axpby"))

    internal = asyncio.run(go())
    batch = AgentLoopWorker._postprocess(w, [internal], input_non_tensor_batch={
        "index": np.array([0], dtype=object), "agent_name": np.array(["cuda_agent"], dtype=object)})
    return internal, batch, server, cfg


def episode_dir(tmp_path: Path) -> Path:
    (d,) = list((tmp_path / "traj").iterdir())
    return d


def check_solved_episode(tmp_path: Path, internal: Any, batch: Any, server: scripted.ScriptedServerManager,
                         cfg: Any) -> None:
    """What the solving episode of `solve_turns()` must give verl (run in test_eval_pool, beside
    the same episode on the Ray evaluation pool: one solved episode for both)."""
    tok = scripted.tokenizer()
    d = episode_dir(tmp_path)
    summary = json.loads((d / "summary.json").read_text())
    # the reward is the final evaluation's, from the real evaluator
    assert summary["reason"] == "finish" and summary["final"]["correct"], summary
    assert internal.reward_score == summary["final"]["reward"] >= 1.0
    # workspace gone (and its trusted record), trajectory kept as optimize writes it
    assert not (d / "workspace").exists() and (d / "trajectory.jsonl").is_file()
    # the batch verl trains on
    rl = cfg.actor_rollout_ref.rollout
    assert batch.batch["prompts"].shape == (1, rl.prompt_length)
    assert batch.batch["responses"].shape == (1, rl.response_length)
    mask = batch.batch["response_mask"][0]
    resp = batch.batch["responses"][0]
    n = int(batch.batch["attention_mask"][0, rl.prompt_length:].sum())
    # mask 1 on exactly the tokens the server sampled, in order; 0 on the tool and template tokens
    sampled = [t for out in server.outputs for t in out]
    assert resp[mask.bool()].tolist() == sampled
    between = tok.decode(resp[:n][~mask[:n].bool()].tolist())
    assert "<tool_response>" in between and "Compile success" in between and "verify success" in between
    assert tok.decode(sampled).count("<tool_call>") == 6
    # every generate call saw exactly the sequence trained on, up to that point
    full = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    for prompt, out in zip(server.prompts, server.outputs, strict=True):
        assert full[:len(prompt) + len(out)] == prompt + out
    # the reward sits on the last response token, which the model produced
    scores = batch.batch["rm_scores"][0]
    assert scores.nonzero().flatten().tolist() == [n - 1] and mask[n - 1] == 1
    assert scores[n - 1].item() == internal.reward_score
    lp = batch.batch["rollout_log_probs"][0]
    assert torch.all(lp[mask.bool()] == scripted.LOGPROB) and torch.all(lp[:n][~mask[:n].bool()] == 0)
    # metrics verl carries beside the batch
    info = internal.extra_fields["reward_extra_info"]
    assert info["compiles"] == 1 and info["compiles_ok"] == 1 and info["verifications"] == 1
    assert info["tool_calls"] == 6 and info["turns"] == 4 and info["correct"] == 1.0
    assert info["speedup_vs_compile"] > 0
    assert batch.non_tensor_batch["compiles"].tolist() == [1.0]


def test_malformed_calls_are_answered_and_the_trajectory_ends_on_a_model_token(tmp_path: Path) -> None:
    texts = ['<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>',  # bad JSON
             '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
             '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>']
    internal, batch, server, cfg = run_loop(tmp_path, texts, max_turns=2)
    tok = scripted.tokenizer()
    summary = json.loads((episode_dir(tmp_path) / "summary.json").read_text())
    assert summary["reason"] == "max-turns" and len(server.prompts) == 2
    # the corrective message is what the model saw before its second call
    second_prompt = tok.decode(server.prompts[1])
    assert "malformed tool call" in second_prompt and "not valid JSON" in second_prompt
    # the last turn's tool output (never answered) is cut: the sequence ends on the model's <|im_end|>
    resp = internal.response_ids[0][internal.attention_mask[0, cfg.actor_rollout_ref.rollout.prompt_length:].bool()]
    assert resp[-1].item() == tok.eos_token_id
    assert internal.reward_score == -1.0  # the starter model_new.py is not a solution
    assert internal.extra_fields["reward_extra_info"]["malformed_calls"] == 1


def test_the_response_budget_ends_the_episode(tmp_path: Path) -> None:
    long = scripted.hermes({"content": "x " * 200, "tool_calls": [{"name": "bash", "arguments": {
        "command": "echo " + "y" * 300}}]})
    internal, batch, server, _ = run_loop(tmp_path, [long] * 10, response_length=700)
    summary = json.loads((episode_dir(tmp_path) / "summary.json").read_text())
    assert summary["reason"] == "context-full", summary
    n = int(internal.attention_mask[0].sum()) - len(server.prompts[0])
    assert n <= 700 and internal.response_mask[0, n - 1] == 1
    assert all(s.get("max_tokens", 0) <= 700 for s in server.sampling)


def test_gae_loses_a_reward_on_a_masked_token() -> None:
    """Why trajectories end on a model token: verl's GAE gives nothing for a reward placed on
    a tool token (mask 0), and the full reward for one on the last model token."""
    mask = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.zeros(1, 5)
    on_tool = torch.zeros(1, 5)
    on_tool[0, 4] = 3.0
    _, returns = compute_gae_advantage_return(on_tool, values, mask, gamma=torch.tensor(1.0),
                                              lam=torch.tensor(0.95))
    assert torch.all(returns == 0)
    on_model = torch.zeros(1, 5)
    on_model[0, 2] = 3.0
    _, returns = compute_gae_advantage_return(on_model, values, mask, gamma=torch.tensor(1.0),
                                              lam=torch.tensor(0.95))
    assert returns[0, 2] == 3.0 and torch.all(returns[0, :3] > 2.5) and torch.all(returns[0, 3:] == 0)


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls('Plan.\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                                      '</tool_call>\n<tool_call>{"name": "finish", "arguments": {}}</tool_call>')
    assert content == "Plan." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("bash", {"command": "ls"}), ("finish", {})]
    # cut off by the token limit, and not JSON: still calls, judged by the loop
    _, calls = parse_tool_calls('<tool_call>{"name": "write_file", "arguments": {"path": "a')
    assert calls[0].name == "write_file" and calls[0].arguments.startswith('{"name"')
    _, calls = parse_tool_calls("<tool_call>bash ls</tool_call>")
    assert calls[0].name == "" and calls[0].arguments == "bash ls"
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_an_edited_history_is_refused() -> None:
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    tok = scripted.tokenizer()
    server = scripted.ScriptedServerManager(['<tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                                             '</tool_call>'])
    client = TokenClient(server, tok, create_continuous_token_builder(tok, hf_model_type="qwen2"))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    c = asyncio.run(client.complete(msgs, []))
    msgs += [c.message(), {"role": "tool", "tool_call_id": c.tool_calls[0].id, "content": "a long output"}]
    msgs[1] = {"role": "user", "content": "changed"}
    with pytest.raises(ModelError, match="append-only"):
        asyncio.run(client.complete(msgs, []))
