"""The single-turn stage's reward: the kernel from one response, scored by the evaluator.

    response -> the last ```python block defining `class ModelNew` (none: -1)
    -> model_new.py in a fresh folder -> load_solution -> evaluate(task of extra_info)
    -> {"score": the evaluator's reward, "acc", "status", speedups, "message"}

verl's reward managers (verl/experimental/reward_loop/reward_manager/naive.py, dapo.py,
limited.py) call `compute_score(data_source=, solution_str=, ground_truth=, extra_info=,
**reward_kwargs)`; a sync function runs in their thread pool. A dict result must hold
"score"; every key goes to the batch's reward_extra_info, batched by the first sample's
keys, so every result has the same keys.

Configure it with `reward.custom_reward_function.path=pkg://cuda_agent.rl.reward`,
`.name=compute_score` and `.reward_kwargs`: `reward_name` (milestone, or speedup
for the ablation; else the CUDA_AGENT_REWARD environment variable, else milestone) and any
scalar `EvalOptions` field (`sandbox`, `trials`, `profile`, `run_timeout_s`, ...).
With `eval_pool: true` (and `eval_resource`, `eval_workers` as in `cuda_agent.eval_pool`)
the kernel is profiled on the Ray evaluation workers instead of where verl runs the reward
(its reward workers share the training nodes), with the workspace commands' options.

A failure of the response (no code, a solution that cannot be read, a failed verdict) is
reward -1; a broken set-up (an unknown option, a dataset row without its task, no sandbox)
raises, since it would otherwise train on -1 everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
from cuda_agent.evaluator.record import EvalResult
from cuda_agent.evaluator.reward import REWARDS
from cuda_agent.evaluator.solution import SolutionError, load_solution
from cuda_agent.sandbox import SandboxUnavailable
from cuda_agent.tasks import Task, TaskError, task_from_code

log = logging.getLogger(__name__)

REWARD_ENV = "CUDA_AGENT_REWARD"
DEFAULT_REWARD = "milestone"
FAILURE = -1.0
# statuses of responses never evaluated (the others are the evaluator's)
NO_CODE = "no_code"  # no ModelNew block
UNREADABLE = "unreadable"  # not a readable solution file
EVAL_ERROR = "error"  # the evaluator failed on it
MESSAGE_CHARS = 500
# keyword arguments verl itself passes to a custom reward function (with a reward model)
VERL_KWARGS = frozenset({"reward_router_address", "reward_model_tokenizer"})
# where the kernel is evaluated: this process, or the Ray evaluation pool
POOL_KWARGS = frozenset({"eval_pool", "eval_resource", "eval_workers", "eval_build_workers"})
# EvalOptions fields a caller may set (scalars); the device comes from the row
_OPTION_FIELDS = {f.name for f in fields(EvalOptions)} - {"protocol", "device"}

_FENCE_OPEN = re.compile(r"^\s*```\s*(python3?|py)\s*$", re.IGNORECASE)
_FENCE_CLOSE = re.compile(r"^\s*```\s*$")
_THINK_END = "</think>"


def extract_model_new(response: str) -> str | None:
    """The last complete ```python block of `response` that defines `class ModelNew`; text
    before a closing </think> (a reasoning model's scratch work) is not the answer."""
    if _THINK_END in response:
        response = response.rsplit(_THINK_END, 1)[1]
    found: str | None = None
    block: list[str] | None = None
    for line in response.splitlines():
        if block is None:
            if _FENCE_OPEN.match(line):
                block = []
        elif _FENCE_CLOSE.match(line):
            code = "\n".join(block) + "\n"
            if re.search(r"^class\s+ModelNew\b", code, re.MULTILINE):
                found = code
            block = None
        else:
            block.append(line)
    return found  # (an unclosed block is a truncated answer: not taken)


def eval_options(extra_info: dict[str, Any], kwargs: dict[str, Any]) -> EvalOptions:
    """The evaluation's options: the row's device, the reward named by `reward_name` (or the
    CUDA_AGENT_REWARD variable, or milestone), and any other EvalOptions field given."""
    unknown = sorted(set(kwargs) - _OPTION_FIELDS - VERL_KWARGS - POOL_KWARGS)
    if unknown:
        raise ValueError(f"the reward function takes no option(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(sorted(_OPTION_FIELDS))}")
    chosen = {k: v for k, v in kwargs.items() if k in _OPTION_FIELDS}
    chosen["reward_name"] = str(chosen.get("reward_name") or os.environ.get(REWARD_ENV)
                                or DEFAULT_REWARD)
    if chosen["reward_name"] not in REWARDS:
        raise ValueError(f"unknown reward {chosen['reward_name']!r}; choose one of "
                         f"{', '.join(REWARDS)}")
    device = str(extra_info.get("device") or "cuda")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"the dataset row's device is {device!r}; use cuda or cpu")
    return EvalOptions(device=device, **chosen)


def task_of(extra_info: dict[str, Any]) -> Task:
    """The task a dataset row of `cuda-agent rl prepare` carries in extra_info."""
    code = extra_info.get("code")
    if not isinstance(code, str) or not code:
        raise ValueError("the dataset row has no extra_info.code (the task); prepare the data "
                         "with `cuda-agent rl prepare`")
    return task_from_code(code, name=str(extra_info.get("task_name") or "task"),
                          source=str(extra_info.get("source") or "<rl dataset>"))


def score_of(result: EvalResult | None, status: str = "", message: str = "") -> dict[str, Any]:
    """verl's result dict (always the same keys): the evaluator's reward exactly, or -1."""
    if result is None:
        return {"score": FAILURE, "acc": 0.0, "status": status, "speedup_vs_eager": None,
                "speedup_vs_compile": None, "message": message[:MESSAGE_CHARS]}
    return {"score": float(result.reward), "acc": float(result.correct), "status": result.status,
            "speedup_vs_eager": result.speedup_vs_eager,
            "speedup_vs_compile": result.speedup_vs_compile,
            "message": result.message[:MESSAGE_CHARS]}


def evaluate_code(task: Task, code: str, options: EvalOptions) -> EvalResult | str:
    """Evaluate `code` as a single file `model_new.py`; the result, or why it could not be
    read as a solution. Raises only for a broken set-up (SandboxUnavailable, TaskError)."""
    folder = Path(tempfile.mkdtemp(prefix="cuda-agent-reward-"))
    try:
        try:
            (folder / "model_new.py").write_text(code, encoding="utf-8")
            solution = load_solution(folder / "model_new.py")
        except (SolutionError, UnicodeError) as exc:
            return f"the response's model_new.py cannot be read: {exc}"
        if options.build_key is None:
            # the same code builds in the same folder, never in one per temporary path
            options.build_key = f"rl-single-turn:{solution.content_hash}"
        return evaluate(task, solution, options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None, **kwargs: Any) -> dict[str, Any]:
    """verl's custom reward function for the single-turn stage (see the module's docstring)."""
    info = dict(extra_info or {})
    options = eval_options(info, kwargs)
    task = task_of(info)
    code = extract_model_new(solution_str or "")
    if code is None:
        return score_of(None, NO_CODE, "no ```python block defining class ModelNew in the response")
    try:
        if kwargs.get("eval_pool"):
            result = _on_pool(task, code, options, kwargs)
        else:
            result = evaluate_code(task, code, options)
    except (SandboxUnavailable, TaskError):
        raise
    except Exception as exc:  # an evaluator failure on this response: its reward, not a crash
        log.exception("evaluating a response for task %s failed", task.name)
        return score_of(None, EVAL_ERROR, f"the evaluation failed: {type(exc).__name__}: {exc}")
    if isinstance(result, str):
        return score_of(None, UNREADABLE, result)
    return score_of(result)


def _on_pool(task: Task, code: str, options: EvalOptions, kwargs: dict[str, Any]) -> EvalResult | str:
    from cuda_agent.evaluator.reward import rescore
    from cuda_agent.rl.eval_pool import profile_files
    from cuda_agent.rl.settings import EvalPoolSettings

    pool = EvalPoolSettings(ray=True, resource=str(kwargs.get("eval_resource") or "kernel_eval_gpu"),
                            workers=int(kwargs.get("eval_workers") or 0),
                            build_workers=int(kwargs.get("eval_build_workers") or 2))
    text, result = profile_files(pool, task, options.device, {"model_new.py": code}, options.sandbox)
    if result is None:
        return f"the response's model_new.py cannot be evaluated: {text.strip()[:MESSAGE_CHARS]}"
    result.reward = rescore(result.to_dict(), options.reward_name, options.threshold)
    result.reward_name = options.reward_name
    return result
