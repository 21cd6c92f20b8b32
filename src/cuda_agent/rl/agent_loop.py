"""`CudaAgentLoop`: verl's agent loop running the episode of `cuda-agent optimize`.

    row (extra_info: the task's code) -> a fresh workspace -> run_episode(task, TokenClient)
    -> the final evaluation's reward -> AgentLoopOutput (tokens, mask, log-probs, reward)
    -> workspace removed; trajectory kept when cuda_agent.trajectories_dir is set

The turns, limits, tools, evaluation commands and scoring are `agent.loop`'s, unchanged;
what differs under RL is the client (tokens from verl's server) and an append-only history
(no elision of old tool outputs: the trained tokens must be the sampled ones).
Registered for verl by `agent_loops.yaml` (name `cuda_agent`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from cuda_agent.agent import trajectory as T
from cuda_agent.agent.loop import AgentConfig, EpisodeSummary, run_episode
from cuda_agent.evaluator.reward import rescore
from cuda_agent.files import atomic_write
from cuda_agent.rl.settings import TOKENS_FILE, RLSettings
from cuda_agent.rl.token_client import TokenClient
from cuda_agent.tasks import task_from_code
from cuda_agent.workspace import remove_workspace

# every episode reports these (verl batches them by the first episode's keys)
METRIC_KEYS = ("turns", "tool_calls", "malformed_calls", "compiles", "compiles_ok", "verifications",
               "profilings", "correct", "speedup_vs_eager", "speedup_vs_compile", "context_full")


def episode_reward(summary: EpisodeSummary, name: str) -> float:
    """The final evaluation's reward under `name` (milestone, or speedup for the ablation);
    -1 when there was no final evaluation."""
    return rescore(summary.final or {}, name)


def episode_metrics(events: list[dict[str, Any]], summary: EpisodeSummary) -> dict[str, float]:
    """Counts of the episode's tool calls and evaluation commands (from its trajectory's
    events), and its final speedups."""
    m = dict.fromkeys(METRIC_KEYS, 0.0)
    m["turns"] = float(summary.turns)
    for e in events:
        if e["type"] == "tool":
            m["tool_calls"] += 1
            m["malformed_calls"] += bool(e.get("malformed"))
        elif e["type"] == "evaluation" and e.get("source") == "agent":
            cmd = e.get("command")
            if cmd == "compile":
                m["compiles"] += 1
                m["compiles_ok"] += e.get("rc") == 0
            elif cmd == "verification":
                m["verifications"] += 1
            elif cmd == "profiling":
                m["profilings"] += 1
    final = summary.final or {}
    m["correct"] = float(bool(final.get("correct")))
    m["speedup_vs_eager"] = float(final.get("speedup_vs_eager") or 0.0)
    m["speedup_vs_compile"] = float(final.get("speedup_vs_compile") or 0.0)
    m["context_full"] = float(summary.reason == "context-full")
    return m


class CudaAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, tools: Any = None, **kwargs: Any) -> None:
        # verl's tool list is not ours: the episode's tools are the workspace's (agent.tools)
        super().__init__(*args, **kwargs)
        self.settings = RLSettings.from_mapping(self.config.get("cuda_agent"))
        self._runner = None
        if self.settings.eval_pool.ray:
            from cuda_agent.rl.eval_pool import ray_runner

            self._runner = ray_runner(self.settings.eval_pool)

    def _agent_config(self) -> AgentConfig:
        s, r = self.settings, self.rollout_config
        return AgentConfig(
            max_turns=s.max_turns, context_tokens=min(s.context_tokens, r.prompt_length + r.response_length),
            max_output_tokens=s.max_output_tokens, wall_time_s=s.wall_time_s,
            command_timeout_s=s.command_timeout_s, sandbox=s.sandbox, elide=False)

    def _episode_dir(self, task_name: str) -> tuple[Path, bool]:
        """Where the episode writes; True if it is kept afterwards (the trajectory)."""
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in task_name)[:80]
        if self.settings.trajectories_dir:
            root = Path(self.settings.trajectories_dir)
            root.mkdir(parents=True, exist_ok=True)
            return root / f"{safe}-{uuid.uuid4().hex[:12]}", True
        return Path(tempfile.mkdtemp(prefix=f"cuda-agent-rl-{safe}-")), False

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = kwargs.get("extra_info") or {}
        if not extra.get("code"):
            raise ValueError("the dataset row has no extra_info.code (the task); prepare the data with "
                             "`cuda-agent rl prepare`")
        task = task_from_code(str(extra["code"]), name=str(extra.get("task_name") or "task"),
                              source=str(extra.get("source") or "<rl dataset>"))
        device = str(extra.get("device") or self.settings.device)
        r = self.rollout_config
        client = TokenClient(self.server_manager, self.tokenizer, self.continuous_token_builder,
                             sampling_params=sampling_params, response_limit=r.response_length,
                             prompt_limit=r.prompt_length, name="verl")
        out, keep = self._episode_dir(task.name)
        try:
            summary = await run_episode(task, client, out, device=device, config=self._agent_config(),
                                        runner=self._runner)
            events = T.read_events(out / "trajectory.jsonl")
            metrics = episode_metrics(events, summary)
            tool_s = sum(float(e.get("seconds") or 0.0) for e in events if e["type"] == "tool")
            messages = sum(1 for e in events if e["type"] == "message")
        finally:
            remove_workspace(out / "workspace")
            if not keep:
                shutil.rmtree(out, ignore_errors=True)
        traj = client.trajectory()
        if keep:  # the exact tokens, for the RFT set (cuda-agent rl rft-filter)
            atomic_write(out / TOKENS_FILE, json.dumps(
                {"v": 1, "prompt_ids": traj.prompt_ids, "response_ids": traj.response_ids,
                 "response_mask": traj.response_mask, "reward": episode_reward(summary, self.settings.reward)}))
        if not traj.response_ids:
            raise ValueError(f"the episode of {task.name} ended before the model produced a token "
                             f"({summary.reason}); nothing to train on")
        score = episode_reward(summary, self.settings.reward)
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.response_ids, response_mask=traj.response_mask,
            response_logprobs=traj.response_logprobs, reward_score=score, num_turns=messages,
            metrics={"generate_sequences": traj.generate_s, "tool_calls": tool_s},
            extra_fields={"reward_extra_info": metrics,
                          "cuda_agent": {"task_id": task.id, "reason": summary.reason,
                                         "final": summary.final, "trajectory": str(out) if keep else None}})
