"""Model clients: one small interface, an OpenAI-compatible implementation and a replay one.

A client takes the conversation (OpenAI chat messages) and the tool schemas and returns
one assistant turn. `OpenAIClient` speaks chat completions with function calling through
the `openai` package's async client, so it works against vLLM, SGLang and hosted APIs.
`ReplayClient` plays back scripted or recorded assistant turns: tests and demos need no
model, and a recorded trajectory can be replayed exactly. `make_client` picks and builds
one of them from the settings the command line, the benchmark and data generation share.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class ModelError(RuntimeError):
    """The model could not be reached or answered unusably, after the retries."""


class ContextFull(ModelError):
    """No room is left in the model's context for another turn (the episode ends there)."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model produced; parsed (and judged) by the loop

    def to_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Completion:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    reasoning: str | None = None  # a reasoning model's separate reasoning text, when sent

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return msg


class ModelClient(Protocol):
    """What the loop needs of a model."""

    name: str

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       max_tokens: int | None = None) -> Completion: ...


@dataclass
class OpenAIConfig:
    model: str
    base_url: str | None = None  # default: $OPENAI_BASE_URL, else the OpenAI API
    api_key: str | None = None  # default: $OPENAI_API_KEY, else "EMPTY" (local servers)
    timeout_s: float = 600.0  # one request
    retries: int = 5  # transient failures: connection, time-out, 408/409/429/5xx
    backoff_s: float = 1.0  # first wait; doubles, with jitter, capped at 60 s
    temperature: float | None = None
    top_p: float | None = None
    extra_body: dict[str, Any] | None = None  # server-specific fields (e.g. vLLM's top_k)


class OpenAIClient:
    def __init__(self, config: OpenAIConfig) -> None:
        import openai

        self.config = config
        self.name = config.model
        self._openai = openai
        # Retries are ours (logged, with back-off we control), not the library's.
        self._client = openai.AsyncOpenAI(
            base_url=config.base_url or os.environ.get("OPENAI_BASE_URL") or None,
            api_key=config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            timeout=config.timeout_s, max_retries=0)
        self.retries_used = 0

    def _transient(self, exc: BaseException) -> bool:
        o = self._openai
        if isinstance(exc, (o.APIConnectionError, o.APITimeoutError, asyncio.TimeoutError)):
            return True
        if isinstance(exc, o.APIStatusError):
            return exc.status_code in (408, 409, 429) or exc.status_code >= 500
        return False

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       max_tokens: int | None = None) -> Completion:
        c = self.config
        kwargs: dict[str, Any] = {"model": c.model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
            kwargs["tool_choice"] = "auto"
        if max_tokens:
            kwargs["max_tokens"] = max_tokens
        if c.temperature is not None:
            kwargs["temperature"] = c.temperature
        if c.top_p is not None:
            kwargs["top_p"] = c.top_p
        if c.extra_body:
            kwargs["extra_body"] = c.extra_body
        delay = c.backoff_s
        for attempt in range(c.retries + 1):
            t0 = time.perf_counter()
            try:
                resp = await self._client.chat.completions.create(**kwargs)
            except Exception as exc:
                if attempt < c.retries and self._transient(exc):
                    self.retries_used += 1
                    await asyncio.sleep(min(60.0, delay) * (0.5 + random.random()))
                    delay *= 2
                    continue
                raise ModelError(f"{type(exc).__name__}: {exc}"[:1000]) from exc
            return _completion(resp, time.perf_counter() - t0)
        raise ModelError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        await self._client.close()


def _completion(resp: Any, latency: float) -> Completion:
    if not getattr(resp, "choices", None):
        raise ModelError("the server returned no choices")
    choice = resp.choices[0]
    msg = choice.message
    calls = []
    for i, tc in enumerate(msg.tool_calls or []):
        fn = getattr(tc, "function", None)
        calls.append(ToolCall(id=tc.id or f"call_{i}", name=getattr(fn, "name", "") or "",
                              arguments=getattr(fn, "arguments", "") or ""))
    usage = getattr(resp, "usage", None)
    extra = getattr(msg, "model_extra", None) or {}
    return Completion(content=msg.content, tool_calls=calls, finish_reason=choice.finish_reason,
                      prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                      completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                      latency_s=latency, reasoning=extra.get("reasoning_content") or extra.get("reasoning"))


# --------------------------------------------------------------------------- replay


def estimate_tokens(obj: Any) -> int:
    """A rough token count (4 characters a token) for servers and clients that report none."""
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return max(1, len(text) // 4)


def turn_from_dict(d: dict[str, Any], index: int) -> Completion:
    """A scripted turn: {"content": ..., "tool_calls": [{"name": ..., "arguments": {...} | "raw"}]}."""
    calls = []
    for j, tc in enumerate(d.get("tool_calls") or []):
        fn = tc.get("function", tc)
        args = fn.get("arguments", {})
        calls.append(ToolCall(id=tc.get("id") or f"call_{index}_{j}", name=fn.get("name", ""),
                              arguments=args if isinstance(args, str) else json.dumps(args)))
    return Completion(content=d.get("content"), tool_calls=calls,
                      finish_reason="tool_calls" if calls else "stop")


def load_script(path: str | Path) -> list[dict[str, Any]]:
    """Assistant turns from a script (JSON list, or JSONL one turn per line) or from a
    trajectory written by the loop (its assistant messages, in order)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except ValueError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if rows and isinstance(rows[0], dict) and "type" in rows[0] and "v" in rows[0]:  # a trajectory
        turns = []
        for e in rows:
            if e.get("type") == "message" and e["message"].get("role") == "assistant":
                m = e["message"]
                turns.append({"content": m.get("content"), "tool_calls": [
                    {"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                    for tc in m.get("tool_calls") or []]})
        return turns
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: each turn must be an object with content and/or tool_calls")
    return rows


class ReplayClient:
    """Plays back assistant turns in order. The turn is chosen by how many assistant
    messages the conversation already holds, so a resumed episode continues where it was."""

    def __init__(self, turns: Sequence[dict[str, Any]], name: str = "replay") -> None:
        self.turns = list(turns)
        self.name = name

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       max_tokens: int | None = None) -> Completion:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        if k >= len(self.turns):
            return Completion(content="(the replay script has no more turns)", finish_reason="stop",
                              prompt_tokens=estimate_tokens(messages))
        c = turn_from_dict(self.turns[k], k)
        c.prompt_tokens = estimate_tokens(messages)
        c.completion_tokens = estimate_tokens(self.turns[k])
        return c


# --------------------------------------------------------------------------- factory


def make_client(model: str, base_url: str | None = None, api_key: str | None = None, *,
                replay: str | Path | None = None, replay_name: str = "replay",
                timeout_s: float | None = None, temperature: float | None = None) -> ModelClient:
    """A `ReplayClient` playing `replay` back when given, else an `OpenAIClient` for `model`.

    `replay_name` is the name a trajectory records for the replay client. Reading the replay
    script raises `OSError` or `ValueError`; `timeout_s` None keeps `OpenAIConfig`'s default.
    """
    if replay:
        return ReplayClient(load_script(replay), name=replay_name)
    config = OpenAIConfig(model=model, base_url=base_url, api_key=api_key, temperature=temperature)
    if timeout_s is not None:
        config.timeout_s = timeout_s
    return OpenAIClient(config)
