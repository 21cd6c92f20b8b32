"""Rewards away from the training GPUs, on the CPU backend: `CudaAgentLoop` hosted in a Ray
actor as verl's agent-loop workers host it, its evaluations sent to Ray evaluation actors
holding the custom resource, gives the verdicts of the same episode evaluated locally."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from cuda_agent.agent import trajectory as T
from cuda_agent.rl import scripted

from .test_agent_loop import TASK, TRAJ_INFO, solve_turns

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def _episode(settings: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    w = scripted.worker(scripted.trainer_config(settings), scripted.ScriptedServerManager(texts))
    internal = await w._run_agent_loop({}, TRAJ_INFO, agent_name="cuda_agent", **scripted.row(TASK, "axpby"))
    batch = AgentLoopWorker._postprocess(w, [internal], input_non_tensor_batch={
        "index": np.array([0], dtype=object), "agent_name": np.array(["cuda_agent"], dtype=object)})
    out = {"reward": internal.reward_score, "rm_sum": float(batch.batch["rm_scores"].sum()),
           "dir": internal.extra_fields["cuda_agent"]["trajectory"], "workers": []}
    if settings.get("eval_pool", {}).get("ray"):
        from cuda_agent.rl.eval_pool import _POOLS

        out["workers"] = [ray.get(a.stats.remote()) for p in _POOLS.values() for a in p.actors]
    return out


@ray.remote(num_cpus=0)
class Host:
    """Where verl runs agent loops: an async Ray actor."""

    async def run(self, settings: dict[str, Any], texts: list[str]) -> dict[str, Any]:
        return await _episode(settings, texts)


def verdicts(directory: str) -> list[tuple[Any, ...]]:
    events = T.read_events(Path(directory) / "trajectory.jsonl")
    return [(e["command"], e["source"], e["rc"], (e.get("result") or {}).get("status"),
             (e.get("result") or {}).get("correct"), (e.get("result") or {}).get("reward"))
            for e in events if e["type"] == "evaluation"]


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=4, resources={"kernel_eval_gpu": 2}, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_an_episode_in_a_ray_actor_evaluated_by_the_ray_pool_matches_the_local_path(
        tmp_path: Path, local_ray: Any) -> None:
    texts = solve_turns()
    base = {"device": "cpu", "reward": "milestone"}
    local = asyncio.run(_episode({**base, "trajectories_dir": str(tmp_path / "local")}, texts))
    remote = ray.get(Host.remote().run.remote(
        {**base, "trajectories_dir": str(tmp_path / "ray"), "eval_pool": {"ray": True}}, texts), timeout=900)
    lv, rv = verdicts(local["dir"]), verdicts(remote["dir"])
    assert [v[:2] for v in lv] == [("compile", "agent"), ("verification", "agent"), ("profiling", "final")]
    # the same verdicts and rewards (the timings differ; the milestone they earn here does not)
    assert lv == rv, (lv, rv)
    assert local["reward"] == remote["reward"] == rv[-1][-1] >= 1.0
    assert remote["rm_sum"] == remote["reward"]
    # the pool did the work: both evaluation actors exist, and together ran every command
    done: dict[str, int] = {}
    for w in remote["workers"]:
        for k, n in w["commands"].items():
            done[k] = done.get(k, 0) + n
    assert len(remote["workers"]) == 2 and done == {"compile": 1, "verification": 1, "profiling": 1}, remote
    summary = json.loads((Path(remote["dir"]) / "summary.json").read_text())
    assert summary["final"]["correct"] and not (Path(remote["dir"]) / "workspace").exists()


def test_the_single_turn_reward_on_the_pool_rescored_for_the_ablation(local_ray: Any) -> None:
    from cuda_agent.rl.reward import compute_score

    from .test_data import RELU_INFO, relu_solution, response

    score = compute_score("ops6k/torch", response(relu_solution("relu_fwd")), RELU_INFO["task_id"],
                          dict(RELU_INFO), reward_name="speedup", eval_pool=True)
    assert score["status"] == "ok" and score["acc"] == 1.0, score
    # profiled on the pool, and the reward is the raw speedup over torch.compile
    assert score["speedup_vs_compile"] and score["score"] == score["speedup_vs_compile"]
    wrong = compute_score("ops6k/torch", response(relu_solution("relu_wrong")), RELU_INFO["task_id"],
                          dict(RELU_INFO), reward_name="speedup", eval_pool=True)
    assert wrong["score"] == -1.0 and wrong["status"] == "incorrect", wrong
