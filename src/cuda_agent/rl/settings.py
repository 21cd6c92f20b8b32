"""Our keys in verl's trainer config: the `cuda_agent:` section the agent loop reads.

    cuda_agent:
      device: cuda              # where kernels are evaluated (cuda, or cpu for C++ kernels)
      reward: milestone         # or speedup (the paper's ablation: t_compile / t)
      max_turns: 150            # model calls per episode (the paper's training setting)
      context_tokens: 131072    # capped by rollout.prompt_length + rollout.response_length
      max_output_tokens: 16384  # per model call
      command_timeout_s: 600
      wall_time_s: 14400
      sandbox: true
      trajectories_dir: null    # keep each episode's trajectory.jsonl and summary.json here
      eval_pool:
        ray: false              # true: verification and profiling on Ray evaluation actors
        resource: kernel_eval_gpu
        workers: 0              # 0: one per unit of the resource in the cluster
        build_workers: 2        # compiling workers (one CPU each) per evaluation node

A missing section means these defaults; an unknown key is an error (a typo would
otherwise train with the default silently).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from cuda_agent.evaluator.reward import REWARDS

# beside an RL episode's trajectory.jsonl: its exact token ids and mask (read by rl rft-filter)
TOKENS_FILE = "tokens.json"


@dataclass
class EvalPoolSettings:
    ray: bool = False
    resource: str = "kernel_eval_gpu"
    workers: int = 0
    build_workers: int = 2


@dataclass
class RLSettings:
    device: str = "cuda"
    reward: str = "milestone"
    max_turns: int = 150
    context_tokens: int = 131_072
    max_output_tokens: int = 16_384
    command_timeout_s: float = 600.0
    wall_time_s: float = 4 * 3600.0
    sandbox: bool = True
    trajectories_dir: str | None = None
    eval_pool: EvalPoolSettings = field(default_factory=EvalPoolSettings)

    @classmethod
    def from_mapping(cls, data: Any) -> RLSettings:
        """From the config section (a dict or an OmegaConf node; None: the defaults)."""
        raw = _plain(data) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"the cuda_agent config section must be a mapping, not {type(raw).__name__}")
        pool = raw.pop("eval_pool", None) or {}
        _check_keys("cuda_agent", raw, cls)
        _check_keys("cuda_agent.eval_pool", pool, EvalPoolSettings)
        s = cls(**raw, eval_pool=EvalPoolSettings(**pool))
        if s.reward not in REWARDS:
            raise ValueError(f"cuda_agent.reward is {s.reward!r}; choose one of {', '.join(REWARDS)}")
        if s.device not in ("cuda", "cpu"):
            raise ValueError(f"cuda_agent.device is {s.device!r}; use cuda or cpu")
        return s


def _plain(data: Any) -> Any:
    if data is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(data, DictConfig):
            return OmegaConf.to_container(data, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    return dict(data) if isinstance(data, dict) else data


def _check_keys(where: str, raw: dict[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)} - {"eval_pool"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where} has no key(s) {', '.join(unknown)}; it takes {', '.join(sorted(known))}")
