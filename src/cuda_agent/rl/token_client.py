"""A `ModelClient` over verl's token server: the episode's exact tokens, mask and log-probs.

The agent loop talks in chat messages; RL trains on tokens. This client sits between:

    first call:  prompt tokens = chat template (messages, tool schemas), generation prompt
    each call:   messages appended since (tool results) -> template tokens, mask 0
                 server_manager.generate(prompt = every token so far) -> model tokens, mask 1
                 model text -> content + tool calls (our parser: a malformed call is still
                 a call, which the loop answers with its corrective message)

History is append-only: the tokens the policy saw are never re-rendered, so the trained
sequence is exactly the sampled one (verl's Continuous Token builder renders each appended
stretch, and refuses a changed earlier message). `trajectory()` cuts the sequence after
the last model token, so the episode's reward lands on a token the policy produced.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from cuda_agent.agent.client import Completion, ContextFull, ModelError, ToolCall

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


def parse_tool_calls(text: str, turn: int = 0) -> tuple[str | None, list[ToolCall]]:
    """Content and tool calls of a model's text in the Hermes format that Qwen-class
    templates use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

    A block that is not such an object (bad JSON, no name, cut off by the token limit)
    still becomes a call, with what could be read of it, so the loop tells the model what
    is wrong instead of ending the episode as if it had stopped calling tools."""
    calls: list[ToolCall] = []
    for j, m in enumerate(TOOL_CALL.finditer(text)):
        raw = m.group(1).strip()
        call_id = f"call_{turn}_{j}"
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ToolCall(call_id, obj["name"], args if isinstance(args, str) else json.dumps(args)))
            continue
        name = _NAME.search(raw)
        # the name, if one can be read, and the whole block as the (malformed) arguments
        calls.append(ToolCall(call_id, name.group(1) if name else "", raw))
    first = text.find("<tool_call>")
    content = (text if first < 0 else text[:first]).strip()
    return content or None, calls


@dataclass
class Trajectory:
    """One episode's tokens as verl's `AgentLoopOutput` wants them."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1: sampled by the policy, 0: tool output or template
    response_logprobs: list[float] | None
    generate_s: float  # time spent waiting for the server


class TokenClient:
    """The loop's model, backed by `server_manager.generate` (verl's `LLMServerClient`).

    `builder` is verl's Continuous Token builder for the tokenizer's chat template;
    `response_limit` bounds the tokens after the prompt (verl's `rollout.response_length`):
    a call with no room left raises `ContextFull`."""

    def __init__(self, server_manager: Any, tokenizer: Any, builder: Any, *,
                 sampling_params: dict[str, Any] | None = None, response_limit: int | None = None,
                 prompt_limit: int | None = None, request_id: str | None = None, name: str = "verl") -> None:
        self.server = server_manager
        self.tokenizer = tokenizer
        self.builder = builder
        self.sampling = dict(sampling_params or {})
        self.response_limit = response_limit
        self.prompt_limit = prompt_limit
        self.request_id = request_id or uuid.uuid4().hex
        self.name = name
        self.token_ids: list[int] = []
        self.prompt_len = 0
        self.mask: list[int] = []
        self.logprobs: list[float] | None = []
        self._seen: list[dict[str, Any]] | None = None  # the conversation the tokens render
        self.generate_s = 0.0
        self.calls = 0

    async def _run(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def _extend_context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        if self._seen is None:
            self.token_ids = list(await self._run(lambda: self.builder.build_initial_tokens(messages, tools=tools)))
            self.prompt_len = len(self.token_ids)
            if self.prompt_limit is not None and self.prompt_len > self.prompt_limit:
                raise ValueError(f"the episode's first prompt is {self.prompt_len} tokens, more than the "
                                 f"{self.prompt_limit} of rollout.prompt_length: raise it (the prompt holds "
                                 "SKILL.md, the tool schemas and the task's code)")
        else:
            seen = self._seen
            try:
                merged = await self._run(lambda: self.builder.merge_context_tokens(
                    seen, messages, self.token_ids, tools=tools))
            except ValueError as exc:  # an earlier message was changed: the tokens would lie
                raise ModelError(f"the conversation is not append-only, as RL needs: {exc}") from exc
            self.mask, self.logprobs = self.builder.align_response_metadata(merged, self.mask, self.logprobs)
            self.token_ids = list(merged.token_ids)
        self._seen = copy.deepcopy(messages)

    def _room(self) -> int | None:
        if self.response_limit is None:
            return None
        return self.response_limit - (len(self.token_ids) - self.prompt_len)

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       max_tokens: int | None = None) -> Completion:
        await self._extend_context(messages, tools)
        room = self._room()
        if room is not None and room <= 0:
            raise ContextFull(f"the episode used its {self.response_limit} response tokens")
        limit = min(x for x in (max_tokens, room) if x is not None) if (max_tokens or room) else None
        params = {**self.sampling, **({"max_tokens": limit} if limit else {})}
        t0 = time.perf_counter()
        try:
            out = await self.server.generate(request_id=self.request_id, prompt_ids=list(self.token_ids),
                                             sampling_params=params)
        except Exception as exc:
            raise ModelError(f"{type(exc).__name__}: {exc}"[:1000]) from exc
        latency = time.perf_counter() - t0
        self.generate_s += latency
        self.calls += 1
        new = list(out.token_ids)
        if not new:
            raise ModelError("the server returned no tokens")
        lps = list(out.log_probs) if out.log_probs is not None else None
        if lps is None or self.logprobs is None:
            self.logprobs = None  # one turn without log-probs: the episode has none
        merged = self.builder.merge_assistant_tokens(self.token_ids, new)
        self.mask, self.logprobs = self.builder.align_response_metadata(
            merged, self.mask, self.logprobs, assistant_logprobs=lps if self.logprobs is not None else None)
        prompt_tokens = len(self.token_ids)
        self.token_ids = list(merged.token_ids)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        content, calls = parse_tool_calls(text, self.calls)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        cut = limit is not None and len(new) >= limit and new[-1] != eos
        c = Completion(content=content, tool_calls=calls,
                       finish_reason="length" if cut else ("tool_calls" if calls else "stop"),
                       prompt_tokens=prompt_tokens, completion_tokens=len(new), latency_s=latency)
        self._seen = [*(self._seen or []), c.message()]
        return c

    def trajectory(self) -> Trajectory:
        """The episode so far, ending on its last model token (what follows it, tool output
        the policy never answered, would only carry the reward off a trained token)."""
        resp_ids = self.token_ids[self.prompt_len:]
        ones = [i for i, m in enumerate(self.mask) if m]
        end = ones[-1] + 1 if ones else 0
        lps = self.logprobs[:end] if self.logprobs is not None else None
        return Trajectory(prompt_ids=self.token_ids[:self.prompt_len], response_ids=resp_ids[:end],
                          response_mask=self.mask[:end], response_logprobs=lps, generate_s=self.generate_s)
