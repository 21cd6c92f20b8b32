"""Episode trajectories: one JSON object per line, written as things happen.

Every line has `v` (schema version), `type`, `turn` and `time`. Types:

- `start`: task (id, name, source, code), device, model, config, workspace
- `message`: one chat message as sent to the model (system, user, assistant, tool)
- `model`: one model call: prompt/completion tokens, latency, finish reason
- `tool`: one tool call: name, arguments, ok, seconds, meta (exit code, ...)
- `evaluation`: a workspace command or scoring run: command, exit code, result record
- `elide`: indices of messages whose content was replaced to save context
- `resume`: the episode was resumed; `dropped` assistant turns that were in flight
- `end`: reason, turns, tokens, seconds, reward, best state

A killed run loses at most the turn in flight: each line is flushed and synced when
written, and `load` rebuilds the conversation from the `message` and `elide` lines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAJECTORY_VERSION = 1
ELIDED = "[output elided to save context: {n} characters]"


class TrajectoryWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the episode)

    def event(self, type_: str, turn: int, **fields: Any) -> dict[str, Any]:
        e = {"v": TRAJECTORY_VERSION, "type": type_, "turn": turn, "time": round(time.time(), 3), **fields}
        line = json.dumps(e, ensure_ascii=False, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        return e

    def close(self) -> None:
        with self._lock:
            self._f.close()


@dataclass
class EpisodeState:
    """What a trajectory file says about an episode so far."""

    start: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    prompt_tokens: int = 0  # of the last model call: the context size then
    completion_tokens_total: int = 0
    prompt_tokens_total: int = 0
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    seconds: float = 0.0  # wall time spent in earlier runs of this episode
    dropped: int = 0  # assistant turns lost in flight


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of a trajectory; a torn last line (a kill mid-write) is ignored."""
    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "type" in e:
            events.append(e)
    return events


def load(path: Path) -> EpisodeState:
    st = EpisodeState()
    events = read_events(path)
    first_time = None
    last_time = None
    for e in events:
        t = e.get("type")
        last_time = e.get("time", last_time)
        if t == "start":
            st.start = e
            first_time = e.get("time")
        elif t == "message":
            st.messages.append(e["message"])
        elif t == "model":
            st.turns = max(st.turns, int(e.get("turn", 0)))
            st.prompt_tokens = int(e.get("prompt_tokens", 0)) + int(e.get("completion_tokens", 0))
            st.prompt_tokens_total += int(e.get("prompt_tokens", 0))
            st.completion_tokens_total += int(e.get("completion_tokens", 0))
        elif t == "elide":
            for i in e.get("indices", []):
                if 0 <= i < len(st.messages):
                    m = st.messages[i]
                    m["content"] = ELIDED.format(n=len(m.get("content") or ""))
        elif t == "evaluation":
            st.evaluations.append(e)
        elif t == "resume":
            st.seconds = float(e.get("seconds_before", st.seconds))
            first_time = e.get("time")
        elif t == "end":
            st.end = e
    if first_time is not None and last_time is not None:
        st.seconds += max(0.0, float(last_time) - float(first_time))
    # A turn in flight: an assistant message whose tool calls have no results yet.
    while st.messages and st.messages[-1].get("role") == "assistant" and st.messages[-1].get("tool_calls"):
        st.messages.pop()
        st.dropped += 1
    if st.messages and st.messages[-1].get("role") == "tool":
        # results of only some of the calls of the last assistant turn: drop that turn whole
        k = len(st.messages) - 1
        while k >= 0 and st.messages[k].get("role") == "tool":
            k -= 1
        if k >= 0 and st.messages[k].get("role") == "assistant":
            wanted = {c["id"] for c in st.messages[k].get("tool_calls") or []}
            got = {m.get("tool_call_id") for m in st.messages[k + 1:]}
            if not wanted <= got:
                del st.messages[k:]
                st.dropped += 1
    return st
