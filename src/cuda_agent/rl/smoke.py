"""`cuda-agent rl smoke`: one tiny end-to-end PPO step, proving the pieces fit.

    tiny tokenizer + random Qwen2 policy and critic (nothing downloaded)
    episodes through CudaAgentLoop in verl's worker code, on the bundled axpby task,
    with the real tools, sandbox and evaluator:
        - one sampled by the tiny policy (it writes noise, so it is scored -1)
        - one whose text is a scripted solution, scored by the same policy's log-probs
          (so the update also sees tool calls, tool output and a positive reward)
    verl's post-processing -> one padded batch
    log-probs recomputed by the policy == the rollout's (the tokens trained are the ones sampled)
    GAE (gamma 1, lambda 0.95) -> clipped policy loss with clip-higher (0.2 / 0.28) + value loss
    -> one AdamW step on policy and critic -> the parameters and the log-probs moved

It trains nothing useful, and says so. What it shows is that our loop, verl's token
bookkeeping and post-processing, and verl's PPO algorithms agree on one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TASK_FILE = EXAMPLES / "tasks" / "axpby.py"
TRAJ_INFO = {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False}


class PolicyServer:
    """verl's `server_manager.generate`, answered by a local causal LM: sampled at
    temperature 1 (`max_tokens` honoured, stopping at <|im_end|>), or, for a scripted text,
    the text's tokens; either way with the model's log-prob of each token."""

    def __init__(self, model: Any, tokenizer: Any, device: str, script: list[str] | None = None,
                 seed: int = 0) -> None:
        import torch

        self.model, self.tok, self.device = model, tokenizer, device
        self.script = script
        self.calls = 0
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def _sample(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        import torch

        out: list[int] = []
        lps: list[float] = []
        past = None
        cur = torch.tensor([prompt], device=self.device)
        with torch.no_grad():
            for _ in range(max_tokens):
                res = self.model(input_ids=cur, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
                t = int(torch.multinomial(logp.exp().cpu(), 1, generator=self.gen))
                out.append(t)
                lps.append(float(logp[t]))
                if t == self.tok.eos_token_id:
                    break
                cur = torch.tensor([[t]], device=self.device)
        return out, lps

    def _score(self, prompt: list[int], new: list[int]) -> list[float]:
        import torch

        ids = torch.tensor([prompt + new], device=self.device)
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        n = len(prompt)
        return [float(logp[n - 1 + i, t]) for i, t in enumerate(new)]

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        limit = int(sampling_params.get("max_tokens") or 64)
        loop = asyncio.get_running_loop()
        if self.script is None:
            ids, lps = await loop.run_in_executor(None, self._sample, list(prompt_ids), limit)
        else:
            text = self.script[self.calls] if self.calls < len(self.script) else "Nothing more."
            ids = (self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])[:limit]
            lps = await loop.run_in_executor(None, self._score, list(prompt_ids), ids)
        self.calls += 1
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed")


def _solution_script(device: str) -> list[str]:
    from cuda_agent.rl.scripted import hermes

    sol = EXAMPLES / "solutions" / f"axpby_{device}"
    files = {"model_new.py": (sol / "model_new.py").read_text()}
    for p in sorted((sol / "kernels").iterdir()):
        files[f"kernels/{p.name}"] = p.read_text()
    bash = [{"name": "bash", "arguments": {"command": c}}
            for c in ("bash utils/compile.sh", "python3 -m utils.verification")]
    return [hermes({"content": "Writing the kernels.", "tool_calls": [
                {"name": "write_file", "arguments": {"path": p, "content": c}} for p, c in files.items()]}),
            hermes({"tool_calls": bash[:1]}), hermes({"tool_calls": bash[1:]}),
            hermes({"content": "Verified.", "tool_calls": [{"name": "finish", "arguments": {"summary": "axpby"}}]})]


def _response_logprobs(model: Any, batch: Any) -> Any:
    """The policy's log-prob of each response token, recomputed on the padded batch."""
    import torch

    b = batch.batch
    p, r = b["prompts"].shape[1], b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, p - 1:p + r - 1].float()
    return torch.gather(torch.log_softmax(logits, -1), 2, b["responses"].unsqueeze(-1)).squeeze(-1)


def _values(critic: Any, batch: Any) -> Any:
    b = batch.batch
    p, r = b["prompts"].shape[1], b["responses"].shape[1]
    out = critic(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    return out.logits[:, p - 1:p + r - 1, 0].float()


def run_smoke(device: str = "cpu", *, scripted_episode: bool = True, sampled_episodes: int = 1,
              out_dir: str | Path | None = None, seed: int = 0, lr: float = 1e-3, response_length: int = 8192,
              progress: Any = print) -> dict[str, Any]:
    """Run the smoke step; returns its report (also written to `out_dir/smoke.json`)."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.core_algos import (
        compute_gae_advantage_return,
        compute_value_loss,
        get_policy_loss_fn,
    )
    from verl.workers.config import ActorConfig

    from cuda_agent.rl import scripted
    from cuda_agent.rl.tiny import tiny_model, tiny_tokenizer
    from cuda_agent.tasks import load_task_file

    t_start = time.perf_counter()
    out = Path(out_dir or tempfile.mkdtemp(prefix="cuda-agent-rl-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(device=device)
    policy = tiny_model(tok, seed=seed).to(device)
    ccfg = Qwen2Config(**{**policy.config.to_dict(), "num_labels": 1, "id2label": {0: "value"},
                          "label2id": {"value": 0}})
    torch.manual_seed(seed + 1)
    critic = Qwen2ForTokenClassification(ccfg).to(device)
    n_params = sum(p.numel() for p in policy.parameters())
    progress(f"tiny policy: Qwen2, {n_params} parameters, random weights; tokenizer: {len(tok)} tokens, trained here")

    task_code = load_task_file(TASK_FILE).code

    def config(max_output: int) -> Any:  # the policy samples a few tokens a turn; the script needs room
        return scripted.trainer_config({"device": device, "trajectories_dir": str(out / "episodes"), "max_turns": 6,
                                        "max_output_tokens": max_output}, prompt_length=4096,
                                       response_length=response_length)

    cfg = config(48)
    scripted._TOKENIZER = tok  # the worker's tokenizer is the policy's

    async def episodes() -> list[Any]:
        servers = [PolicyServer(policy, tok, device, seed=seed + k) for k in range(sampled_episodes)]
        if scripted_episode:
            servers.append(PolicyServer(policy, tok, device, script=_solution_script(device)))
        results = []
        for k, server in enumerate(servers):  # one after another: they share the policy and the device
            kind = "scripted solution" if server.script else "sampled by the policy"
            progress(f"episode {k + 1}/{len(servers)} ({kind}) ...")
            w = scripted.worker(config(4096) if server.script else cfg, server)
            internal = await w._run_agent_loop({"temperature": 1.0}, TRAJ_INFO, agent_name="cuda_agent",
                                               **scripted.row(task_code, "axpby", device))
            results.append((w, internal, kind))
        return results

    eps = asyncio.run(episodes())
    w = eps[0][0]
    batch = AgentLoopWorker._postprocess(w, [i for _, i, _ in eps], input_non_tensor_batch={
        "index": np.arange(len(eps), dtype=object), "agent_name": np.array(["cuda_agent"] * len(eps), dtype=object)})
    batch.batch = batch.batch.to(device)
    b = batch.batch
    mask = b["response_mask"].float()
    episodes_report = [{"kind": kind, "reward": i.reward_score, "reason": i.extra_fields["cuda_agent"]["reason"],
                        "response_tokens": int(i.attention_mask[0, cfg.actor_rollout_ref.rollout.prompt_length:].sum()),
                        "model_tokens": int(i.response_mask.sum()), **i.extra_fields["reward_extra_info"]}
                       for _, i, kind in eps]

    # the tokens trained on are the ones sampled: recomputed log-probs == the rollout's
    policy.eval()
    with torch.no_grad():
        old = _response_logprobs(policy, batch)
        values = _values(critic, batch)
    drift = float(((old - b["rollout_log_probs"]).abs() * mask).max())

    # verl's algorithms, as its trainer calls them
    rewards = b["rm_scores"].float()
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=torch.tensor(1.0), lam=torch.tensor(0.95))
    actor_cfg = ActorConfig(strategy="fsdp", rollout_n=1, clip_ratio_low=0.2, clip_ratio_high=0.28,
                            ppo_mini_batch_size=len(eps), ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    policy_loss = get_policy_loss_fn("vanilla")
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW([*policy.parameters(), *critic.parameters()], lr=lr)
    policy.train()
    critic.train()
    lp = _response_logprobs(policy, batch)
    pg_loss, pg_metrics = policy_loss(old, lp, adv, mask, "token-mean", actor_cfg)
    vf_loss, vf_clipfrac = compute_value_loss(_values(critic, batch), ret, values, mask, cliprange_value=0.5)
    opt.zero_grad()
    (pg_loss + 0.5 * vf_loss).backward()
    opt.step()
    moved = float(sum((p.detach() - q).norm() ** 2 for p, q in zip(policy.parameters(), before, strict=True)) ** 0.5)
    policy.eval()
    with torch.no_grad():
        after = _response_logprobs(policy, batch)
    ratio = torch.exp(after - old)
    report = {
        "device": device, "policy_parameters": n_params, "episodes": episodes_report,
        "batch": {k: list(v.shape) for k, v in b.items()},
        "logprob_max_abs_diff_rollout_vs_recomputed": drift,
        "reward_on_last_model_token": all(
            float(rewards[i].nonzero().flatten()[-1]) == float(mask[i].nonzero().flatten()[-1])
            for i in range(len(eps)) if rewards[i].any()),
        "pg_loss": pg_loss.item(), "vf_loss": vf_loss.item(), "vf_clipfrac": float(vf_clipfrac), **pg_metrics,
        "advantage_abs_mean": float((adv.abs() * mask).sum() / mask.sum()),
        "policy_parameter_change_norm": moved,
        "ratio_after_update": {"min": float(ratio[mask.bool()].min()), "max": float(ratio[mask.bool()].max())},
        "seconds": round(time.perf_counter() - t_start, 2),
        "note": "a random tiny model: this trains nothing useful; it proves the pieces fit",
    }
    (out / "smoke.json").write_text(json.dumps(report, indent=1))
    return report


def _print(report: dict[str, Any]) -> None:
    print("\nepisodes (CudaAgentLoop, real tools, sandbox and evaluator):")
    for e in report["episodes"]:
        print(f"  {e['kind']:22s} reward {e['reward']:+g}  ({e['reason']}; {e['turns']:g} turns, "
              f"{e['tool_calls']:g} tool calls, {e['compiles']:g} compiles, {e['verifications']:g} verifications; "
              f"{e['model_tokens']} of {e['response_tokens']} response tokens from the model)")
    print(f"batch from verl's post-processing: {report['batch']['input_ids']} input ids")
    print(f"log-probs, rollout vs recomputed: max |diff| {report['logprob_max_abs_diff_rollout_vs_recomputed']:.2e}")
    print(f"reward on the last model token: {report['reward_on_last_model_token']}")
    print(f"PPO step (verl's GAE, vanilla clipped loss 0.2/0.28, value loss): pg_loss {report['pg_loss']:.4f}, "
          f"vf_loss {report['vf_loss']:.4f}, ppo_kl {report['actor/ppo_kl']:.2e}")
    print(f"policy parameters moved by {report['policy_parameter_change_norm']:.4f} (L2); ratio after the step "
          f"{report['ratio_after_update']['min']:.4f}..{report['ratio_after_update']['max']:.4f}")
    print(f"{report['seconds']} s. Note: {report['note']}.")


def add_cli(sub: argparse._SubParsersAction) -> None:
    sm = sub.add_parser("smoke", help="one tiny end-to-end PPO step with our agent loop (proves the pieces fit)")
    sm.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the tiny model runs and kernels are evaluated")
    sm.add_argument("--no-scripted", action="store_true",
                    help="skip the scripted-solution episode (no compile, no evaluation of a real kernel)")
    sm.add_argument("--sampled", type=int, default=1, help="episodes sampled by the tiny policy")
    sm.add_argument("--out", help="folder for the episodes and smoke.json (default: a new temporary folder)")
    sm.add_argument("--json", action="store_true", help="print the report as JSON")
    sm.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    try:
        import verl  # noqa: F401
    except ImportError as exc:
        raise ValueError("rl smoke needs verl: pip install -e '.[rl]'") from exc
    quiet = args.json
    report = run_smoke(args.device, scripted_episode=not args.no_scripted, sampled_episodes=args.sampled,
                       out_dir=args.out, progress=(lambda *_: None) if quiet else print)
    if quiet:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    ok = report["logprob_max_abs_diff_rollout_vs_recomputed"] < 1e-3 and report["policy_parameter_change_norm"] > 0
    return 0 if ok else 1
