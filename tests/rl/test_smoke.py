"""`cuda-agent rl smoke` on the CPU: episodes from a random tiny policy through CudaAgentLoop,
verl's post-processing, and one PPO update with verl's algorithms."""

from __future__ import annotations

from pathlib import Path

from cuda_agent.rl.smoke import run_smoke


def test_one_ppo_step_moves_the_policy_and_keeps_the_sampled_log_probs(tmp_path: Path) -> None:
    r = run_smoke("cpu", scripted_episode=False, sampled_episodes=2, out_dir=tmp_path, response_length=1024,
                  progress=lambda *_: None)
    assert len(r["episodes"]) == 2 and all(e["reward"] == -1.0 for e in r["episodes"])  # noise is no kernel
    assert all(0 < e["model_tokens"] <= e["response_tokens"] <= 1024 for e in r["episodes"])
    assert r["batch"]["input_ids"] == [2, 4096 + 1024]
    # the trained tokens are the sampled ones: the policy gives them the log-probs the rollout recorded
    assert r["logprob_max_abs_diff_rollout_vs_recomputed"] < 1e-4
    assert r["reward_on_last_model_token"]
    # one update: parameters and log-probs moved, within what one clipped step does
    assert r["policy_parameter_change_norm"] > 0
    assert r["ratio_after_update"]["min"] < 1.0 < r["ratio_after_update"]["max"]
    assert (tmp_path / "smoke.json").is_file() and len(list((tmp_path / "episodes").iterdir())) == 2
