"""Doubles speaking verl's protocols, for tests and demos: a token server that plays back
scripted model texts, and an `AgentLoopWorker` made the way verl's CPU tests make one
(no Ray, no model), with our loops registered from `agent_loops.yaml`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

import cuda_agent.rl
from cuda_agent.rl.tiny import tiny_tokenizer

AGENT_LOOPS = Path(cuda_agent.rl.__file__).parent / "agent_loops.yaml"
LOGPROB = -0.25  # what the scripted server says each sampled token's log-prob was

_TOKENIZER: Any = None


def tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tiny_tokenizer()
    return _TOKENIZER


def hermes(turn: dict[str, Any]) -> str:
    """A scripted turn ({"content", "tool_calls": [{"name", "arguments"}]}) as the model's text."""
    parts = [turn["content"]] if turn.get("content") else []
    for c in turn.get("tool_calls") or []:
        args = c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"])
        parts.append('<tool_call>{"name": ' + json.dumps(c["name"]) + ', "arguments": ' + args + "}</tool_call>")
    return "\n".join(parts)


class ScriptedServerManager:
    """`generate` answers with the next scripted text's tokens (ending in <|im_end|>) and
    records every prompt it was sent."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.sampling: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        tok = tokenizer()
        k = len(self.prompts)
        text = self.texts[k] if k < len(self.texts) else "I have nothing more to do."
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        if sampling_params.get("max_tokens"):
            ids = ids[: sampling_params["max_tokens"]]
        self.prompts.append(list(prompt_ids))
        self.outputs.append(ids)
        self.sampling.append(dict(sampling_params))
        return TokenOutput(token_ids=ids, log_probs=[LOGPROB] * len(ids), stop_reason="completed")


def trainer_config(cuda_agent: dict[str, Any], prompt_length: int = 8192, response_length: int = 16384) -> Any:
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "prompt_length": prompt_length, "response_length": response_length,
            "multi_turn": {"tool_config_path": None},
            "agent": {"agent_loop_config_path": str(AGENT_LOOPS)}},
            "model": {"path": "tiny", "tokenizer_path": "tiny"}},
        "data": {"apply_chat_template_kwargs": {}},
        "cuda_agent": cuda_agent})


def worker(config: Any, server: Any) -> AgentLoopWorker:
    """An `AgentLoopWorker` as verl's CPU tests make one (no Ray, no model): our loops
    registered from the YAML as its constructor does, the rest what `_run_agent_loop` and
    the post-processing read."""
    for entry in OmegaConf.load(AGENT_LOOPS):
        verl_agent_loop._agent_loop_registry[entry.name] = entry
    w = object.__new__(AgentLoopWorker)
    w.config = config
    w.rollout_config = config.actor_rollout_ref.rollout
    w.llm_client = server
    w.tokenizer = tokenizer()
    w.processor = None
    w.hf_model_type = "qwen2"
    w.dataset_cls = RLHFDataset
    w.tools = []
    w.reward_loop_worker_handles = None
    w.distillation_enabled = False
    w.mm_processor_kwargs = {}
    return w


def row(task_code: str, name: str, device: str = "cpu") -> dict[str, Any]:
    return {"raw_prompt": np.array([{"role": "user", "content": "(the task)"}], dtype=object),
            "extra_info": {"code": task_code, "task_name": name, "device": device, "index": 0},
            "index": 0}
