"""`cuda-agent rl rft-filter`: agent episodes to the rejection fine-tuning (RFT) set.

    TRAJECTORIES (trajectory.jsonl files, episode folders, or folders searched for them:
    an `optimize --out`, a `bench --agent` out, an RL `cuda_agent.trajectories_dir`)
    -> each episode kept, or dropped for the first reason below that applies
    -> FILE              parquet for verl's SFT trainer, read by `sft_dataset.RFTDataset`
    -> FILE.report.json  counts kept and dropped per reason, and every episode's verdict

Drop reasons, in the order they are checked:

- `unreadable`: no start event in the trajectory, or a tokens.json that is not the
  episode's tokens (bad JSON, lengths that disagree, a mask that is not 0/1).
- `unfinished`: no end event (killed), or it ended `interrupted` or `model-error`.
- `cut-off`: it ended `length`: its last turn was cut by the token limit mid-message.
- `elided`: old tool outputs were elided: the conversation trained on would not be the
  one the model saw.
- `resumed-dropped-turns`: it was resumed after losing a turn in flight (same reason).
- `not-rewarded`: reward <= min_reward. The reward is the final evaluation's (the state
  the trajectory ends in; -1 if that evaluation left no record), else the summary's.
- `turn-cap`: more than max_turns model calls, or it ended `max-turns`.
- `malformed-tool-call`: a `tool` event with `malformed: true`.
- `repeated-action`: a redundant loop, one of
  (a) the same call (tool name + arguments as canonical JSON, keys sorted) `repeat_limit`
      (3) or more times in a row in the episode's sequence of calls;
  (b) the same pair of different calls repeated `repeat_limit` times in a row
      (A B A B A B: e.g. writing the same file and compiling it again, three times);
  (c) an assistant turn identical to the one before it, text (non-empty) and calls.
  Running a command twice is often honest work (compile, look, compile again); a third
  identical call in a row, an identical edit-and-build cycle, or a model repeating its own
  words verbatim after seeing a result is the loop the paper's filter removes.
- `tokenizer-mismatch`, `template-error` (only with a tokenizer to check against): token
  ids outside its vocabulary; a conversation its chat template cannot render with
  assistant spans.

Other ends (finish, no-tool-call, wall-time, context-full) are kept if nothing above applies.

Rows (one parquet file; `kind` says which, and `RFTDataset` reads both):

- `tokens`: an episode with tokens.json (from verl's rollout): `input_ids` = prompt_ids +
  response_ids, `loss_mask` = 0 on the prompt, response_mask on the response (1 exactly on
  the tokens the policy sampled). Training on these is training on what was sampled.
- `messages`: any other episode: `messages` and `tools` (the agent's tool schemas) as
  JSON strings (parquet structs would fill every message with every other message's keys),
  the conversation up to its last assistant turn, tool-call arguments as JSON objects.

Every row also has `reward`, `turns`, `reason`, `task_id`, `task_name` and `episode`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cuda_agent.files import atomic_write
from cuda_agent.rl.settings import TOKENS_FILE

REPORT_VERSION = 1
TRAJECTORY_FILE = "trajectory.jsonl"  # as agent.loop names an episode's files
SUMMARY_FILE = "summary.json"
REPORT_SUFFIX = ".report.json"
KIND_TOKENS = "tokens"
KIND_MESSAGES = "messages"
DROP_REASONS = ("unreadable", "unfinished", "cut-off", "elided", "resumed-dropped-turns",
                "not-rewarded", "turn-cap", "malformed-tool-call", "repeated-action",
                "tokenizer-mismatch", "template-error")
UNFINISHED_ENDS = ("interrupted", "model-error", "unknown")


@dataclass
class Verdict:
    episode: str  # the episode folder
    kept: bool
    reason: str | None = None  # why it was dropped (one of DROP_REASONS)
    detail: str = ""
    kind: str | None = None  # the row's kind, when kept
    reward: float | None = None
    turns: int | None = None
    task_id: str | None = None
    task_name: str | None = None
    length: int | None = None  # tokens of the row, when known


class Drop(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# --------------------------------------------------------------------------- finding episodes


def find_trajectories(paths: list[str | Path]) -> list[Path]:
    """The trajectory files named by `paths`, each once; ValueError for a path that does not
    exist or a folder that holds none."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"{p} does not exist")
        if p.is_file():
            hits = [p]
        elif (p / TRAJECTORY_FILE).is_file():
            hits = [p / TRAJECTORY_FILE]
        else:
            hits = sorted(p.rglob(TRAJECTORY_FILE))
            if not hits:
                raise ValueError(f"no {TRAJECTORY_FILE} under {p}")
        for h in hits:
            found.setdefault(h.resolve(), None)
    return list(found)


# --------------------------------------------------------------------------- the pattern filter


def call_key(name: str, arguments: Any) -> str:
    """A tool call as one comparable string: its name and canonical JSON arguments."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{name} {arguments}"
    return f"{name} {json.dumps(arguments, sort_keys=True, ensure_ascii=False)}"


def repeated_block(keys: list[str], repeat_limit: int) -> tuple[int, int] | None:
    """(start, period) of the first run of one call (period 1) or one pair of different
    calls (period 2) repeated `repeat_limit` times in a row; None if there is none."""
    for period in (1, 2):
        span = period * repeat_limit
        for i in range(len(keys) - span + 1):
            block = keys[i:i + period]
            if period == 2 and block[0] == block[1]:
                continue
            if keys[i:i + span] == block * repeat_limit:
                return i, period
    return None


def _assistant_turns(events: list[dict[str, Any]]) -> list[tuple[int, str, list[str]]]:
    """(turn, text, call keys) of each assistant message, in order."""
    out = []
    for e in events:
        m = e.get("message") if e.get("type") == "message" else None
        if isinstance(m, dict) and m.get("role") == "assistant":
            fns = [c.get("function") or {} for c in m.get("tool_calls") or []]
            calls = [call_key(fn.get("name", ""), fn.get("arguments", "")) for fn in fns]
            out.append((int(e.get("turn", 0)), (m.get("content") or "").strip(), calls))
    return out


def redundant_loop(events: list[dict[str, Any]], repeat_limit: int) -> str | None:
    """What makes the episode a redundant loop (rules a-c of the module docstring), or None."""
    turns = _assistant_turns(events)
    calls = [(turn, key) for turn, _, keys in turns for key in keys]
    hit = repeated_block([k for _, k in calls], repeat_limit)
    if hit is not None:
        i, period = hit
        first, last = calls[i][0], calls[i + period * repeat_limit - 1][0]
        what = (calls[i][1][:120] if period == 1
                else f"the pair {calls[i][1][:60]} / {calls[i + 1][1][:60]}")
        return f"{what} {repeat_limit} times in a row (turns {first}-{last})"
    for (_, text_a, calls_a), (turn, text_b, calls_b) in zip(turns, turns[1:], strict=False):
        if text_a and text_a == text_b and calls_a == calls_b:
            return f"assistant turn {turn} repeats the one before it word for word"
    return None


# --------------------------------------------------------------------------- one episode


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def final_reward(summary: dict[str, Any], events: list[dict[str, Any]]) -> float | None:
    final = summary.get("final")
    if isinstance(final, dict) and final.get("reward") is not None:
        return float(final["reward"])
    for e in reversed(events):
        if e.get("type") == "evaluation" and e.get("source") == "final":
            rec = e.get("result")
            scored = isinstance(rec, dict) and rec.get("reward") is not None
            return float(rec["reward"]) if scored else -1.0
    return float(summary["reward"]) if summary.get("reward") is not None else None


def training_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: up to the last assistant turn (the
    trained sequence ends on a model token), no None content, tool-call arguments as
    objects (what Qwen-class templates serialise)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    out = []
    for m in messages[:last + 1]:
        m = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = fn.get("arguments")
                fn["arguments"] = args if isinstance(args, dict) else fn.get("arguments")
                calls.append({"id": c.get("id"), "type": "function", "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _token_row(path: Path) -> tuple[list[int], list[int]]:
    data = _read_json(path)
    try:
        prompt, response, mask = data["prompt_ids"], data["response_ids"], data["response_mask"]
        ok = (len(response) == len(mask) > 0 and set(mask) <= {0, 1}
              and all(isinstance(t, int) and t >= 0 for t in (*prompt, *response)))
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise Drop("unreadable", f"{path} is not an episode's tokens (prompt_ids, response_ids, "
                                 "response_mask)")
    return [*prompt, *response], [0] * len(prompt) + list(mask)


def _checks(trajectory: Path, v: Verdict, *, max_turns: int, min_reward: float,
            repeat_limit: int) -> str:
    """Raise `Drop` for the first reason the episode fails; its end reason otherwise."""
    from cuda_agent.agent.trajectory import read_events

    try:
        events = read_events(trajectory)
    except OSError as exc:
        raise Drop("unreadable", f"{trajectory}: {exc.strerror or exc}") from None
    start = next((e for e in events if e.get("type") == "start"), None)
    if start is None:
        raise Drop("unreadable", f"{trajectory} has no start event")
    task = start.get("task") or {}
    v.task_id, v.task_name = task.get("id"), task.get("name")
    end = next((e for e in reversed(events) if e.get("type") == "end"), None)
    summary = _read_json(trajectory.parent / SUMMARY_FILE)
    summary = summary if isinstance(summary, dict) else end
    if summary is None:
        raise Drop("unfinished", "no end event: the episode was stopped before it ended")
    reason = str(summary.get("reason"))
    v.turns = int(summary.get("turns") or sum(e.get("type") == "model" for e in events))
    if reason in UNFINISHED_ENDS:
        raise Drop("unfinished", f"it ended {reason}")
    if reason == "length":
        raise Drop("cut-off", "its last turn was cut by the output token limit")
    if any(e.get("type") == "elide" for e in events):
        raise Drop("elided", "old tool outputs were elided from the conversation")
    dropped = sum(int(e.get("dropped") or 0) for e in events if e.get("type") == "resume")
    if dropped:
        raise Drop("resumed-dropped-turns", f"resumed after losing {dropped} turn(s) in flight")
    v.reward = final_reward(summary, events)
    if v.reward is None or not v.reward > min_reward:
        raise Drop("not-rewarded", f"reward {v.reward} is not above {min_reward:g}")
    if v.turns > max_turns or reason == "max-turns":
        raise Drop("turn-cap", f"{v.turns} turns, ended {reason} (cap {max_turns})")
    bad = [e for e in events if e.get("type") == "tool" and e.get("malformed")]
    if bad or reason == "malformed-tool-calls":
        where = f" (turn {bad[0].get('turn')})" if bad else ""
        raise Drop("malformed-tool-call", f"{len(bad)} malformed tool call(s){where}")
    loop = redundant_loop(events, repeat_limit)
    if loop:
        raise Drop("repeated-action", loop)
    return reason


def _row_data(trajectory: Path, v: Verdict, tokenizer: Any) -> dict[str, Any]:
    """The kind-specific columns of a kept episode's row."""
    tokens = trajectory.parent / TOKENS_FILE
    if tokens.is_file():
        ids, mask = _token_row(tokens)
        if tokenizer is not None and max(ids) >= len(tokenizer):
            raise Drop("tokenizer-mismatch", f"token id {max(ids)} is outside the tokenizer's "
                                             f"{len(tokenizer)} ids")
        v.length = len(ids)
        return {"kind": KIND_TOKENS, "input_ids": ids, "loss_mask": mask}
    from cuda_agent.agent.tools import SCHEMAS
    from cuda_agent.agent.trajectory import load

    messages = training_messages(load(trajectory).messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise Drop("unfinished", "the conversation has no assistant turn")
    if tokenizer is not None:
        from cuda_agent.rl.sft_dataset import encode_conversation

        try:
            v.length = len(encode_conversation(tokenizer, messages, SCHEMAS)[0])
        except Exception as exc:  # a template's failure is this episode's, not the run's
            raise Drop("template-error", f"{type(exc).__name__}: {exc}"[:300]) from None
    return {"kind": KIND_MESSAGES, "messages": json.dumps(messages, ensure_ascii=False),
            "tools": json.dumps(SCHEMAS, ensure_ascii=False)}


def judge(trajectory: Path, *, max_turns: int = 150, min_reward: float = 0.0,
          repeat_limit: int = 3, tokenizer: Any = None) -> tuple[Verdict, dict[str, Any] | None]:
    """The episode's verdict, and its parquet row if kept."""
    v = Verdict(episode=str(trajectory.parent), kept=False)
    try:
        reason = _checks(trajectory, v, max_turns=max_turns, min_reward=min_reward,
                         repeat_limit=repeat_limit)
        row = {"reward": v.reward, "turns": v.turns, "reason": reason, "task_id": v.task_id,
               "task_name": v.task_name, "episode": v.episode,
               **_row_data(trajectory, v, tokenizer)}
    except Drop as d:
        v.reason, v.detail = d.reason, d.detail
        return v, None
    v.kept, v.kind = True, row["kind"]
    return v, row


# --------------------------------------------------------------------------- the set


def parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("kind", pa.string()), ("input_ids", pa.list_(pa.int32())),
                      ("loss_mask", pa.list_(pa.int8())), ("messages", pa.string()),
                      ("tools", pa.string()), ("reward", pa.float64()), ("turns", pa.int32()),
                      ("reason", pa.string()), ("task_id", pa.string()),
                      ("task_name", pa.string()), ("episode", pa.string())])


def report_path(out_file: str | Path) -> Path:
    out = Path(out_file)
    return out.with_name(out.name + REPORT_SUFFIX)


def rft_filter(paths: list[str | Path], out_file: str | Path, *, max_turns: int = 150,
               min_reward: float = 0.0, repeat_limit: int = 3,
               tokenizer: Any = None) -> dict[str, Any]:
    """Write the RFT set of the episodes under `paths` to `out_file` (parquet) and its report
    beside it (`out_file` + `.report.json`); returns the report. `tokenizer` (an object or a
    path for `AutoTokenizer`) checks token rows' ids and renders messages rows."""
    from cuda_agent.tasks.loaders import import_pyarrow

    out = Path(out_file)
    import_pyarrow(out, "writing")
    import pyarrow as pa
    import pyarrow.parquet as pq

    if max_turns < 1 or repeat_limit < 2:
        raise ValueError("--max-turns must be at least 1 and --repeat-limit at least 2")
    trajectories = find_trajectories(paths)
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    verdicts, rows = [], []
    for t in trajectories:
        v, row = judge(t, max_turns=max_turns, min_reward=min_reward, repeat_limit=repeat_limit,
                       tokenizer=tokenizer)
        verdicts.append(v)
        if row is not None:
            rows.append(row)
    table = pa.Table.from_pylist(rows, schema=parquet_schema())
    atomic_write(out, lambda fh: pq.write_table(table, fh))
    dropped = Counter(v.reason for v in verdicts if not v.kept)
    lengths = [v.length for v in verdicts if v.kept and v.length is not None]
    report = {
        "v": REPORT_VERSION,
        "out": str(out),
        "inputs": [str(p) for p in paths],
        "rules": {"min_reward": min_reward, "max_turns": max_turns, "repeat_limit": repeat_limit,
                  "tokenizer": getattr(tokenizer, "name_or_path", None)},
        "episodes": len(verdicts),
        "kept": len(rows),
        "kept_by_kind": {k: sum(r["kind"] == k for r in rows)
                         for k in (KIND_TOKENS, KIND_MESSAGES)},
        "dropped": {r: dropped[r] for r in DROP_REASONS if dropped[r]},
        "longest_row_tokens": max(lengths, default=None),
        "verdicts": [asdict(v) for v in verdicts],
    }
    atomic_write(report_path(out), json.dumps(report, indent=1) + "\n")
    return report


# --------------------------------------------------------------------------- command line


def cmd_rft_filter(args: argparse.Namespace) -> int:
    report = rft_filter(args.trajectories, args.out, max_turns=args.max_turns,
                        min_reward=args.min_reward, repeat_limit=args.repeat_limit,
                        tokenizer=args.tokenizer)
    kinds = report["kept_by_kind"]
    print(f"kept {report['kept']} of {report['episodes']} episodes ({kinds[KIND_TOKENS]} token "
          f"rows, {kinds[KIND_MESSAGES]} messages rows) -> {args.out}")
    for reason, n in report["dropped"].items():
        print(f"  dropped {n:5d}  {reason}")
    if report["longest_row_tokens"]:
        print(f"longest row: {report['longest_row_tokens']} tokens (data.max_length must cover it)")
    print(f"report: {report_path(args.out)}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rft-filter", help="agent trajectories to the RFT set for verl's "
                              "SFT trainer (reward > 0, no loops, no malformed calls)")
    p.add_argument("trajectories", nargs="+",
                   help="trajectory.jsonl files, episode folders, or folders searched for them")
    p.add_argument("--out", required=True,
                   help="the parquet file to write (its report goes beside it)")
    p.add_argument("--max-turns", type=int, default=150, help="drop episodes with more model calls")
    p.add_argument("--min-reward", type=float, default=0.0,
                   help="keep episodes whose reward is above this")
    p.add_argument("--repeat-limit", type=int, default=3,
                   help="drop episodes repeating one call (or one pair of calls) this many "
                        "times in a row")
    p.add_argument("--tokenizer", help="the model's tokenizer (a path or hub name): check token "
                                       "rows' ids, render messages rows, report their lengths")
    p.set_defaults(func=cmd_rft_filter)
