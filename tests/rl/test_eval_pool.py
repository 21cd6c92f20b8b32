"""Rewards away from the training GPUs, on the CPU backend: `CudaAgentLoop` hosted in a Ray
actor as verl's agent-loop workers host it, its evaluations sent to Ray evaluation actors
holding the custom resource, gives the verdicts of the same episode evaluated locally."""

from __future__ import annotations

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

from .test_agent_loop import TASK, TRAJ_INFO, check_solved_episode, run_loop, solve_turns

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


def verdicts(directory: str | Path) -> list[tuple[Any, ...]]:
    """(command, source, exit code, status, correct) of each evaluation, and the rewards (the
    milestone depends on timings, which differ between two runs on a loaded machine)."""
    events = T.read_events(Path(directory) / "trajectory.jsonl")
    return [(e["command"], e["source"], e["rc"], (e.get("result") or {}).get("status"),
             (e.get("result") or {}).get("correct")) for e in events if e["type"] == "evaluation"]


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=4, resources={"kernel_eval_gpu": 2}, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_an_episode_in_a_ray_actor_evaluated_by_the_ray_pool_matches_the_local_path(
        tmp_path: Path, local_ray: Any) -> None:
    texts = solve_turns()
    # the local path, in verl's worker code in this process: everything verl is given
    internal, batch, server, cfg = run_loop(tmp_path, texts)
    check_solved_episode(tmp_path, internal, batch, server, cfg)
    (local_dir,) = list((tmp_path / "traj").iterdir())
    # the same episode in a Ray actor, its evaluations on the Ray pool
    host = Host.remote()
    remote = ray.get(host.run.remote(
        {"device": "cpu", "trajectories_dir": str(tmp_path / "ray"), "eval_pool": {"ray": True}}, texts),
        timeout=900)
    # the evaluation workers outlive the agent-loop worker that made them (the next test uses them)
    ray.kill(host)
    lv, rv = verdicts(local_dir), verdicts(remote["dir"])
    assert lv == [("compile", "agent", 0, None, None), ("verification", "agent", 0, "ok", True),
                  ("profiling", "final", 0, "ok", True)]
    assert rv == lv
    assert internal.reward_score >= 1.0 and remote["reward"] >= 1.0 and remote["rm_sum"] == remote["reward"]
    # the pool did the work: the compile on a build worker, the verifications on the "GPU" workers
    done: dict[str, dict[str, int]] = {"gpu": {}, "build": {}}
    for w in remote["workers"]:
        for k, n in w["commands"].items():
            done[w["role"]][k] = done[w["role"]].get(k, 0) + n
    roles = sorted(w["role"] for w in remote["workers"])
    assert roles == ["build", "build", "gpu", "gpu"], remote["workers"]
    assert done == {"build": {"compile": 1}, "gpu": {"verification": 1, "profiling": 1}}, done
    summary = json.loads((Path(remote["dir"]) / "summary.json").read_text())
    assert summary["final"]["correct"] and not (Path(remote["dir"]) / "workspace").exists()


def test_the_single_turn_reward_on_the_pool_rescored_for_the_ablation(local_ray: Any) -> None:
    """(After the test above: the pool's workers were made by its killed Host actor.)"""
    from cuda_agent.rl.reward import compute_score

    from .test_data import RELU_INFO, relu_solution, response

    score = compute_score("ops6k/torch", response(relu_solution("relu_fwd")), RELU_INFO["task_id"],
                          dict(RELU_INFO), reward_name="speedup", eval_pool=True)
    assert score["status"] == "ok" and score["acc"] == 1.0, score
    # profiled on the pool, and the reward is the raw speedup over torch.compile (1 for a correct
    # solution whose timing could not be trusted on a loaded machine: no speedup then)
    assert score["score"] == (score["speedup_vs_compile"] or 1.0), score
