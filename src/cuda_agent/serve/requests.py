"""What a client may ask of the evaluation service, checked before anything runs.

A request is JSON:

    {"task": {"code": "...", "name": "axpby"},
     "solution": {"files": {"model_new.py": "...", "kernels/axpby.cu": "..."}},
     "options": {"profile": true},          # optional: the fields in CLIENT_OPTIONS
     "mode": "evaluate",                    # or "build": static checks and the build only;
                                            # "prefetch": the task's baselines (no solution)
     "client": "episode-17",                # optional: fair scheduling is per client
     "deadline_s": 600,                     # optional: answered "deadline" after this
     "build_key": "episode-17/axpby"}       # optional: a kept build directory, so the
                                            # next variant's one-file edit builds incrementally

Everything else an evaluation needs (device, GPU, sandbox, time and memory limits,
threads, timing protocol) is the service's, never the client's: a client cannot turn the
sandbox off or pick a GPU that another evaluation is timing on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cuda_agent.evaluator.reward import REWARDS
from cuda_agent.evaluator.solution import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES

MAX_BODY_BYTES = 8 << 20  # a request's JSON
MAX_NAME = 200  # task name, client, build key
MODES = ("evaluate", "build", "prefetch")


class RequestError(ValueError):
    """A malformed or refused request: `status` is the HTTP status it is answered with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _number(lo: float, hi: float, integer: bool = False) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
            raise RequestError(f"options.{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
        if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
            raise RequestError(f"options.{name} must be between {lo:g} and {hi:g}, got {v!r}")
        return v
    return check


def _boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"options.{name} must be true or false, got {v!r}")
    return v


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if v not in choices:
            raise RequestError(f"options.{name} must be one of {', '.join(choices)}; got {v!r}")
        return str(v)
    return check


def _seed(name: str, v: Any) -> int | None:
    return None if v is None else _number(0, 2**31 - 1, integer=True)(name, v)


# The EvalOptions fields a client chooses, with their checks.
CLIENT_OPTIONS: dict[str, Callable[[str, Any], Any]] = {
    "profile": _boolean,
    "atol": _number(0.0, 1.0),
    "rtol": _number(0.0, 1.0),
    "trials": _number(1, 20, integer=True),
    "distribution_trials": _number(0, 10, integer=True),
    "seed": _seed,
    "reward_name": _one_of(*REWARDS),
    "threshold": _number(0.0, 1.0),
    "compile_mode": _one_of("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
}


def _text(where: str, v: Any, limit: int = MAX_NAME) -> str:
    if not isinstance(v, str) or not v.strip():
        raise RequestError(f"{where} must be a non-empty string")
    if len(v) > limit:
        raise RequestError(f"{where} is longer than {limit} characters")
    return v


@dataclass(frozen=True)
class EvalRequest:
    task_code: str
    task_name: str
    files: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)  # client-chosen EvalOptions fields
    mode: str = "evaluate"
    client: str = "anonymous"
    deadline_s: float | None = None
    build_key: str | None = None

    def key(self) -> str:
        """What the result cache is keyed by: the task, the solution's content, the options
        and the mode (not who asked, when, or into which build directory)."""
        body = json.dumps([self.task_code, sorted(self.files.items()), sorted(self.options.items()), self.mode],
                          separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": {"code": self.task_code, "name": self.task_name},
                               "solution": {"files": self.files}, "options": self.options, "mode": self.mode,
                               "client": self.client}
        if self.deadline_s is not None:
            out["deadline_s"] = self.deadline_s
        if self.build_key is not None:
            out["build_key"] = self.build_key
        return out

    @classmethod
    def parse(cls, data: Any) -> EvalRequest:
        """A request from decoded JSON; RequestError says what is wrong with it."""
        if not isinstance(data, dict):
            raise RequestError("the request must be a JSON object")
        unknown = set(data) - {"task", "solution", "options", "mode", "client", "deadline_s", "build_key"}
        if unknown:
            raise RequestError(f"unknown request field(s): {', '.join(sorted(unknown))}")
        task = data.get("task")
        if not isinstance(task, dict) or not isinstance(task.get("code"), str):
            raise RequestError("task must be an object with the task's code: {\"code\": ..., \"name\": ...}")
        code = _text("task.code", task["code"], MAX_FILE_BYTES)
        name = _text("task.name", task.get("name", "task"))
        sol = data.get("solution")
        if sol is None and data.get("mode") == "prefetch":
            sol = {"files": {"model_new.py": ""}}
        files = sol.get("files") if isinstance(sol, dict) else None
        if not isinstance(files, dict) or not files:
            raise RequestError("solution must be an object with its files: {\"files\": {\"model_new.py\": ...}}")
        if len(files) > MAX_FILES + 1:
            raise RequestError(f"the solution has {len(files)} files; at most {MAX_FILES + 1}", 413)
        total = 0
        for rel, text in files.items():
            if not isinstance(rel, str) or not isinstance(text, str):
                raise RequestError("solution.files maps relative paths to file text")
            parts = rel.split("/")
            if rel != "model_new.py" and (parts[0] != "kernels" or len(parts) < 2 or any(p in ("", ".", "..") for p in parts)):
                raise RequestError(f"solution file {rel!r}: only model_new.py and files under kernels/ are a solution's")
            if len(text) > MAX_FILE_BYTES:
                raise RequestError(f"solution file {rel} is larger than {MAX_FILE_BYTES} bytes", 413)
            total += len(text)
        if total > MAX_TOTAL_BYTES:
            raise RequestError(f"the solution's files exceed {MAX_TOTAL_BYTES} bytes in all", 413)
        if "model_new.py" not in files:
            raise RequestError("the solution has no model_new.py")
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise RequestError("options must be an object")
        bad = set(options) - set(CLIENT_OPTIONS)
        if bad:
            raise RequestError(f"option(s) not a client's to choose: {', '.join(sorted(bad))} "
                               f"(choose among {', '.join(CLIENT_OPTIONS)})")
        options = {k: CLIENT_OPTIONS[k](k, v) for k, v in sorted(options.items())}
        mode = data.get("mode", "evaluate")
        if mode not in MODES:
            raise RequestError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        deadline = data.get("deadline_s")
        if deadline is not None:
            deadline = float(_number(0.001, 7 * 24 * 3600.0)("deadline_s", deadline))
        build_key = data.get("build_key")
        return cls(task_code=code, task_name=name, files=dict(files), options=options, mode=mode,
                   client=_text("client", data.get("client", "anonymous")), deadline_s=deadline,
                   build_key=None if build_key is None else _text("build_key", build_key))

    @classmethod
    def from_body(cls, body: bytes) -> EvalRequest:
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"the request is larger than {MAX_BODY_BYTES} bytes", 413)
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise RequestError(f"the request is not valid JSON: {exc}") from None
        return cls.parse(data)

    def describe(self) -> dict[str, Any]:
        """The request without its code, for logs and answers."""
        d = asdict(self)
        d.pop("task_code")
        d["files"] = sorted(self.files)
        return d
