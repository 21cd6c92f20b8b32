"""`cuda-agent rl rft-filter` and `RFTDataset`: which episodes the RFT set keeps and why,
rows that verl's SFT trainer loads through its own `create_sft_dataset`, token rows equal to
what the rollout sampled, and a loss on exactly the assistant tokens of messages rows."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from cuda_agent.agent.loop import EpisodeSummary
from cuda_agent.agent.tools import SCHEMAS
from cuda_agent.agent.trajectory import TrajectoryWriter
from cuda_agent.cli import main
from cuda_agent.rl import rft, scripted
from cuda_agent.rl.sft_dataset import RFTDataset, encode_conversation

REPO = Path(__file__).resolve().parents[2]
TASK = (REPO / "examples" / "tasks" / "axpby.py").read_text()
CUSTOM_CLS = {"path": "pkg://cuda_agent.rl.sft_dataset", "name": "RFTDataset"}

Call = tuple[str, dict[str, Any]]


def bash(command: str) -> Call:
    return ("bash", {"command": command})


def write_episode(folder: Path, turns: list[tuple[str | None, list[Call]]], *,
                  reward: float | None = 1.0, reason: str = "finish",
                  summary_reward: float | None = None, ended: bool = True,
                  malformed_turn: int | None = None, elide: bool = False,
                  resume_dropped: int | None = None,
                  tokens: dict[str, Any] | str | None = None) -> Path:
    """An episode folder as `agent.loop` writes one (through its own trajectory writer):
    start, the two first messages, per turn a model event, the assistant message and each
    call's tool event and tool message; then the final evaluation, end and summary.json.
    `reward` None: no final evaluation (the summary's reward counts)."""
    folder.mkdir(parents=True)
    w = TrajectoryWriter(folder / "trajectory.jsonl")
    task = {"id": "t-" + folder.name, "name": folder.name, "source": "x.py", "code": TASK}
    w.event("start", 0, task=task, device="cpu", model="m", config={},
            workspace=str(folder / "workspace"))
    w.event("message", 0, message={"role": "system", "content": "You write kernels."})
    w.event("message", 0, message={"role": "user", "content": "Task `axpby`: make it faster."})
    for n, (text, calls) in enumerate(turns, start=1):
        w.event("model", n, prompt_tokens=100 * n, completion_tokens=10, latency_s=0.1,
                finish_reason="stop")
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = [{"id": f"call_{n}_{j}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for j, (name, args) in enumerate(calls)]
        w.event("message", n, message=msg)
        for j, (name, args) in enumerate(calls):
            bad = n == malformed_turn
            w.event("tool", n, call_id=f"call_{n}_{j}", name=name, arguments=args, ok=not bad,
                    **({"malformed": True} if bad else {}), seconds=0.01)
            w.event("message", n, message={"role": "tool", "tool_call_id": f"call_{n}_{j}",
                                           "content": f"output of {name} {j}"})
        if elide and n == 2:
            w.event("elide", n, indices=[3])
        if resume_dropped is not None and n == 1:
            w.event("resume", n, dropped=resume_dropped, seconds_before=1.0)
    final = None
    if reward is not None:
        final = {"status": "ok" if reward > 0 else "rejected", "correct": reward > 0,
                 "reward": reward, "message": "", "rule": None, "speedup_vs_eager": 1.1,
                 "speedup_vs_compile": 1.05, "flags": []}
        w.event("evaluation", len(turns), command="profiling", argv=[], rc=0, source="final",
                result=final, output="")
    if ended:
        best = summary_reward if summary_reward is not None else (reward or -1.0)
        s = EpisodeSummary(reason=reason, turns=len(turns), reward=best, correct=best > 0,
                           speedup_vs_eager=None, speedup_vs_compile=None, best_from="final",
                           prompt_tokens=1, completion_tokens=1, seconds=1.0,
                           task_id=task["id"], task_name=folder.name, model="m",
                           out_dir=str(folder), final=final)
        w.event("end", s.turns, **{k: v for k, v in s.to_dict().items() if k != "v"})
        (folder / "summary.json").write_text(json.dumps(s.to_dict()))
    w.close()
    if tokens is not None:
        text = tokens if isinstance(tokens, str) else json.dumps(tokens)
        (folder / "tokens.json").write_text(text)
    return folder


GOOD = [("Writing the kernel.", [("write_file", {"path": "model_new.py", "content": "x"})]),
        (None, [bash("bash utils/compile.sh"), bash("python3 -m utils.verification")]),
        ("Done.", [("finish", {"summary": "ok"})])]
TOKENS = {"v": 1, "prompt_ids": [5, 6, 7, 8], "response_ids": [20, 21, 22, 9, 10, 23, 24],
          "response_mask": [1, 1, 1, 0, 0, 1, 1], "reward": 1.0}
MAKE = (None, [bash("make")])
WRITE_AND_MAKE = (None, [("write_file", {"path": "a", "content": "1"}), bash("make")])

# folder name -> (how it is written, the reason it is dropped for; None: kept)
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "kept_messages": ({"turns": GOOD}, None),
    "kept_tokens": ({"turns": GOOD, "tokens": TOKENS}, None),
    "kept_twice_in_a_row": ({"turns": [MAKE, MAKE, *GOOD]}, None),
    "kept_resumed_whole": ({"turns": GOOD, "resume_dropped": 0}, None),
    "kept_no_final_evaluation": ({"turns": GOOD, "reward": None, "summary_reward": 1.0}, None),
    "kept_no_tool_call_end": ({"turns": [*GOOD[:2], ("All done.", [])],
                               "reason": "no-tool-call"}, None),
    "zero_reward": ({"turns": GOOD, "reward": 0.0}, "not-rewarded"),
    "failed": ({"turns": GOOD, "reward": -1.0}, "not-rewarded"),
    "final_broken_best_earlier": ({"turns": GOOD, "reward": -1.0, "summary_reward": 2.0},
                                  "not-rewarded"),
    "killed": ({"turns": GOOD[:2], "ended": False}, "unfinished"),
    "model_error": ({"turns": GOOD[:2], "reason": "model-error"}, "unfinished"),
    "cut_off": ({"turns": GOOD[:2], "reason": "length"}, "cut-off"),
    "elided": ({"turns": GOOD, "elide": True}, "elided"),
    "resumed_lost_a_turn": ({"turns": GOOD, "resume_dropped": 1}, "resumed-dropped-turns"),
    "too_many_turns": ({"turns": [(None, [bash(f"echo {i}")]) for i in range(6)]}, "turn-cap"),
    "ended_at_the_cap": ({"turns": GOOD, "reason": "max-turns"}, "turn-cap"),
    "malformed": ({"turns": GOOD, "malformed_turn": 1}, "malformed-tool-call"),
    "same_call_3x": ({"turns": [MAKE, MAKE, MAKE, *GOOD[2:]]}, "repeated-action"),
    "same_call_3x_in_one_turn": ({"turns": [(None, [bash("ls")] * 3), *GOOD[2:]]},
                                 "repeated-action"),
    "same_pair_3x": ({"turns": [WRITE_AND_MAKE] * 3 + GOOD[2:]}, "repeated-action"),
    "same_turn_twice": ({"turns": [GOOD[0], GOOD[0], *GOOD[1:]]}, "repeated-action"),
    "bad_tokens": ({"turns": GOOD, "tokens": "{not json"}, "unreadable"),
    "short_mask": ({"turns": GOOD, "tokens": {**TOKENS, "response_mask": [1]}}, "unreadable"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cases under a bench-like tree (OUT/episodes/LEVEL/TASK), plus garbage."""
    root = tmp_path_factory.mktemp("runs") / "bench"
    for name, (kw, _) in CASES.items():
        kw = dict(kw)
        write_episode(root / "episodes" / "level1" / name, kw.pop("turns"), **kw)
    garbage = root / "episodes" / "level2" / "garbage"
    garbage.mkdir(parents=True)
    (garbage / "trajectory.jsonl").write_text("not json\n{\"half\": \n")
    return root


def test_the_filter_keeps_and_drops_each_episode_for_its_reason(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "rft" / "sft.parquet"
    report = rft.rft_filter([runs], out, max_turns=5)
    by_name = {Path(v["episode"]).name: v for v in report["verdicts"]}
    expected = {name: why for name, (_, why) in CASES.items()} | {"garbage": "unreadable"}
    assert {n: v["reason"] for n, v in by_name.items()} == expected
    assert all(v["kept"] == (v["reason"] is None) for v in by_name.values())
    assert report["episodes"] == len(CASES) + 1
    kept = sorted(n for n, why in expected.items() if why is None)
    assert report["kept"] == len(kept)
    assert report["kept_by_kind"] == {"tokens": 1, "messages": len(kept) - 1}
    assert report["dropped"] == {"unreadable": 3, "unfinished": 2, "cut-off": 1, "elided": 1,
                                 "resumed-dropped-turns": 1, "not-rewarded": 3, "turn-cap": 2,
                                 "malformed-tool-call": 1, "repeated-action": 4}
    assert "3 times in a row" in by_name["same_pair_3x"]["detail"]
    assert "the pair" in by_name["same_pair_3x"]["detail"]
    assert "word for word" in by_name["same_turn_twice"]["detail"]
    # the final evaluation's reward, not the best state's; the summary's without a final one
    assert by_name["final_broken_best_earlier"]["reward"] == -1.0
    assert by_name["kept_no_final_evaluation"]["reward"] == 1.0
    assert json.loads(rft.report_path(out).read_text()) == report
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["task_name"] for r in rows) == kept
    assert pq.read_table(out).schema == rft.parquet_schema()
    # messages rows: JSON strings, ending on the last assistant turn, arguments as objects
    row = next(r for r in rows if r["task_name"] == "kept_messages")
    assert row["input_ids"] is None and json.loads(row["tools"]) == SCHEMAS
    msgs = json.loads(row["messages"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                         "tool", "assistant"]
    assert msgs[4]["content"] == "" and msgs[4]["tool_calls"][1]["function"] == {
        "name": "bash", "arguments": {"command": "python3 -m utils.verification"}}


def test_stricter_rules(runs: Path, tmp_path: Path) -> None:
    level1 = runs / "episodes" / "level1"
    report = rft.rft_filter([level1 / "kept_messages",
                             level1 / "kept_messages" / "trajectory.jsonl"],
                            tmp_path / "x.parquet", min_reward=1.0)
    assert report["episodes"] == 1 and report["dropped"] == {"not-rewarded": 1}  # named twice: once
    report = rft.rft_filter([level1 / "kept_twice_in_a_row"], tmp_path / "x.parquet",
                            repeat_limit=2)
    assert report["dropped"] == {"repeated-action": 1}
    report = rft.rft_filter([level1 / "kept_twice_in_a_row"], tmp_path / "x.parquet", max_turns=4)
    assert report["dropped"] == {"turn-cap": 1}


def test_the_pattern_rules() -> None:
    a, b, c = "a", "b", "c"
    assert rft.repeated_block([a, a, b, a, a], 3) is None
    assert rft.repeated_block([b, a, a, a], 3) == (1, 1)
    assert rft.repeated_block([c, a, b, a, b, a, b], 3) == (1, 2)
    assert rft.repeated_block([a, b, a, b, c], 3) is None
    # argument order and spacing do not make calls different
    assert rft.call_key("bash", '{"command": "ls", "timeout": 5}') == rft.call_key(
        "bash", {"timeout": 5, "command": "ls"})
    assert rft.call_key("bash", "not json") != rft.call_key("bash", "{}")


def test_token_rows_round_trip_through_verls_loader(runs: Path, tmp_path: Path) -> None:
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    out = tmp_path / "sft.parquet"
    rft.rft_filter([runs / "episodes" / "level1" / "kept_tokens"], out)
    (row,) = pq.read_table(out).to_pylist()
    ids = TOKENS["prompt_ids"] + TOKENS["response_ids"]
    loss = [0] * len(TOKENS["prompt_ids"]) + TOKENS["response_mask"]
    assert row["kind"] == "tokens" and row["input_ids"] == ids and row["loss_mask"] == loss
    assert row["messages"] is None
    tok = scripted.tokenizer()
    cfg = OmegaConf.create({"custom_cls": CUSTOM_CLS, "pad_mode": "no_padding", "max_length": 64,
                            "truncation": "error"})
    ds = create_sft_dataset(str(out), cfg, tok, None)
    assert isinstance(ds, RFTDataset) and len(ds) == 1
    item = ds[0]
    assert set(item) == {"input_ids", "position_ids", "loss_mask"}
    assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == loss
    # the loss falls on exactly the sampled tokens (verl shifts the mask onto the predictions)
    assert item["input_ids"][item["loss_mask"].bool()].tolist() == [20, 21, 22, 23, 24]
    batch = SFTTensorCollator("no_padding")([item, item])
    assert batch["input_ids"].is_nested and batch["loss_mask"].values().sum() == 10
    # right padding: verl's keys, padded to max_length
    ds = create_sft_dataset([str(out)], OmegaConf.merge(cfg, {"pad_mode": "right"}), tok, None)
    item = ds[0]
    assert set(item) == {"input_ids", "attention_mask", "position_ids", "loss_mask"}
    assert item["input_ids"].shape == (64,) and item["attention_mask"].sum() == len(ids)
    assert item["loss_mask"][len(ids):].sum() == 0
    assert item["input_ids"][len(ids)] == tok.pad_token_id
    # too long for max_length: an error (verl's default) or left out, never cut
    with pytest.raises(ValueError, match="longer than data.max_length=8"):
        RFTDataset(str(out), tok, OmegaConf.merge(cfg, {"max_length": 8}))
    drop = OmegaConf.merge(cfg, {"max_length": 8, "truncation": "drop"})
    assert len(RFTDataset(str(out), tok, drop)) == 0
    with pytest.raises(ValueError, match="would cut"):
        RFTDataset(str(out), tok, OmegaConf.merge(cfg, {"truncation": "right"}))


def conversation() -> list[dict[str, Any]]:
    def call(i: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}

    return [{"role": "system", "content": "You write kernels."},
            {"role": "user", "content": "Make axpby faster."},
            {"role": "assistant", "content": "Looking first.", "tool_calls": [
                call("c1", "read_file", {"path": "model.py"}),
                call("c2", "bash", {"command": "ls"})]},
            {"role": "tool", "tool_call_id": "c1", "content": "import torch"},
            {"role": "tool", "tool_call_id": "c2", "content": "model.py\nkernels"},
            {"role": "assistant", "content": "",
             "tool_calls": [call("c3", "finish", {"summary": "ok"})]},
            {"role": "tool", "tool_call_id": "c3", "content": "finished"},
            {"role": "assistant", "content": "All done."}]


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


def test_messages_rows_train_on_exactly_the_assistant_tokens() -> None:
    tok = scripted.tokenizer()
    msgs = conversation()
    ids, mask = encode_conversation(tok, msgs, SCHEMAS)
    # the whole conversation's tokens, as the template renders it at once: the two consecutive
    # tool results share one user turn (rendering message by message would not)
    assert ids == tok.apply_chat_template(msgs, tools=SCHEMAS, tokenize=True, return_dict=False)
    text = tok.decode(ids)
    assert text.count("<|im_start|>user") == 3 and "</tool_response>\n<tool_response>" in text
    texts = [tok.decode(run) for run in masked_runs(ids, mask)]
    assert [t.lstrip("\n") for t in texts] == [
        'Looking first.\n<tool_call>{"name": "read_file", "arguments": {"path": "model.py"}}'
        '</tool_call>'
        '\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call><|im_end|>',
        '<tool_call>{"name": "finish", "arguments": {"summary": "ok"}}</tool_call><|im_end|>',
        "All done.<|im_end|>"]
    # nothing else is trained on: no tool output, no template, no newline after <|im_end|>
    unmasked = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "import torch" in unmasked and "model.py\nkernels" in unmasked
    assert not any(t in unmasked for t in ("Looking first", '{"summary": "ok"}', "All done"))


def run_episode(tmp_path: Path, texts: list[str],
                monkeypatch: pytest.MonkeyPatch) -> tuple[Path, scripted.ScriptedServerManager]:
    """A real RL episode: `CudaAgentLoop` in verl's worker code with a scripted token server,
    the tiny tokenizer, our tools and the CPU evaluator. Nothing is built or timed, so the
    service's start-up prefetch (baselines, precompiled headers: a minute in a fresh cache)
    is skipped: a few seconds."""
    monkeypatch.setattr("cuda_agent.workspace.commands.prefetch",
                        lambda *a, **k: {"baselines": "off"})
    cfg = scripted.trainer_config({"device": "cpu", "trajectories_dir": str(tmp_path / "traj")})
    server = scripted.ScriptedServerManager(texts)
    w = scripted.worker(cfg, server)
    asyncio.run(w._run_agent_loop({"temperature": 1.0},
                                  {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False},
                                  agent_name="cuda_agent", **scripted.row(TASK, "axpby")))
    (folder,) = list((tmp_path / "traj").iterdir())
    return folder, server


def test_a_real_rl_episode_as_token_and_messages_rows(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_agent.rl.settings import TOKENS_FILE

    texts = [scripted.hermes({"content": "Looking around.", "tool_calls": [
                 {"name": "read_file", "arguments": {"path": "model.py"}},
                 {"name": "bash", "arguments": {"command": "ls"}}]}),
             "All done."]
    folder, server = run_episode(tmp_path, texts, monkeypatch)
    tokens = json.loads((folder / TOKENS_FILE).read_text())
    report = rft.rft_filter([tmp_path / "traj"], tmp_path / "a.parquet")
    assert report["dropped"] == {"not-rewarded": 1}  # the starter model_new.py is no solution
    # the same episode as if its final evaluation had passed (solving costs minutes of builds)
    solved = tmp_path / "solved" / folder.name
    shutil.copytree(folder, solved)
    summary = json.loads((solved / "summary.json").read_text())
    summary["final"]["reward"] = 1.0
    (solved / "summary.json").write_text(json.dumps(summary))
    tok = scripted.tokenizer()
    out = tmp_path / "b.parquet"
    report = rft.rft_filter([solved], out, tokenizer=tok)
    assert report["kept_by_kind"] == {"tokens": 1, "messages": 0}
    ds = RFTDataset(str(out), tok, {"pad_mode": "no_padding", "max_length": 16384})
    item = ds[0]
    assert item["input_ids"].tolist() == tokens["prompt_ids"] + tokens["response_ids"]
    assert report["longest_row_tokens"] == len(item["input_ids"])
    # the loss covers exactly the tokens the server sampled, in order
    sampled = [t for out_ids in server.outputs for t in out_ids]
    assert item["input_ids"][item["loss_mask"].bool()].tolist() == sampled
    # without tokens.json (an optimize or bench episode): a messages row of the same conversation
    (solved / TOKENS_FILE).unlink()
    out = tmp_path / "c.parquet"
    report = rft.rft_filter([solved], out, tokenizer=tok)
    assert report["kept_by_kind"] == {"tokens": 0, "messages": 1}
    ds = RFTDataset(str(out), tok, {"pad_mode": "no_padding", "max_length": 16384})
    item = ds[0]
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    texts_trained = [tok.decode(run).lstrip("\n") for run in masked_runs(ids, mask)]
    assert texts_trained == [texts[0] + "<|im_end|>", "All done.<|im_end|>"]
    # with this template, rendering the conversation gives the rollout's very tokens and mask
    # (then the template's newline after the last <|im_end|>, not trained on)
    n = len(tokens["prompt_ids"]) + len(tokens["response_ids"])
    assert ids[:n] == tokens["prompt_ids"] + tokens["response_ids"] and len(ids) == n + 1
    assert mask[:n] == [0] * len(tokens["prompt_ids"]) + tokens["response_mask"] and mask[n] == 0
    assert report["longest_row_tokens"] == len(ids)


def test_mixed_kinds_in_one_file(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "mixed.parquet"
    level1 = runs / "episodes" / "level1"
    rft.rft_filter([level1 / "kept_tokens", level1 / "kept_messages"], out)
    tok = scripted.tokenizer()
    cfg = OmegaConf.create({"pad_mode": "no_padding", "max_length": 4096})
    ds = RFTDataset([str(out)], tok, cfg)
    kinds = pq.read_table(out).column("kind").to_pylist()
    assert sorted(kinds) == ["messages", "tokens"]
    for i, kind in enumerate(kinds):
        item = ds[i]
        assert item["loss_mask"].sum() > 0 and item["input_ids"].dtype == torch.long
        if kind == "messages":
            trained = tok.decode(item["input_ids"][item["loss_mask"].bool()].tolist())
            assert trained.endswith('{"summary": "ok"}}</tool_call><|im_end|>')
    # ids from another tokenizer are refused when the dataset is built
    rows = pq.read_table(out).to_pylist()
    for r in rows:
        if r["kind"] == "tokens":
            r["input_ids"][0] = len(tok) + 5
    big = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=rft.parquet_schema()), big)
    with pytest.raises(ValueError, match="another tokenizer"):
        RFTDataset(str(big), tok, {"max_length": 4096})


def test_cli(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok_dir = tmp_path / "tok"
    scripted.tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "sft.parquet"
    assert main(["rl", "rft-filter", str(runs), "--out", str(out), "--max-turns", "5",
                 "--tokenizer", str(tok_dir)]) == 0
    printed = capsys.readouterr().out
    assert f"kept 6 of {len(CASES) + 1} episodes (1 token rows, 5 messages rows)" in printed
    assert "repeated-action" in printed and out.is_file() and rft.report_path(out).is_file()
    assert main(["rl", "rft-filter", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["rl", "rft-filter", str(tmp_path / "empty"), "--out", str(out)]) == 2
