"""`cuda-agent rl prepare` and the single-turn reward: parquet rows that verl's own dataset
reads back unchanged, a deterministic disjoint split, and rewards from the real evaluator
on the CPU backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cuda_agent.agent.loop import initial_messages
from cuda_agent.cli import main
from cuda_agent.rl import data
from cuda_agent.rl.reward import REWARD_ENV, compute_score, eval_options, extract_model_new
from cuda_agent.tasks import compute_task_id
from cuda_agent.workspace import skill_text


def task_code(forward: str, inputs: str, *, init: str = "", init_inputs: str = "[]") -> str:
    return (
        "import torch\nimport torch.nn as nn\n\n\n"
        "class Model(nn.Module):\n"
        f"    def __init__(self{init}):\n        super().__init__()\n\n"
        f"    def forward(self, x):\n        return {forward}\n\n\n"
        f"def get_inputs():\n    return [{inputs}]\n\n\n"
        f"def get_init_inputs():\n    return {init_inputs}\n"
    )


RELU = task_code("torch.relu(x)", "torch.randn(16, 4096)")
TANH = task_code("torch.tanh(x)", "torch.randn(8, 256)")
ROW_SUM = task_code("x.sum(dim=1)", "torch.randn(32, 64)")
SCALE = task_code("x * 3.0", "torch.randn(4, 128)", init=", k=3", init_inputs="[3]")
CODES = [RELU, TANH, ROW_SUM, SCALE]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "tasks"
    root.mkdir()
    for name, code in [("1_ReLU", RELU), ("2_Tanh", TANH), ("3_RowSum", ROW_SUM)]:
        (root / f"{name}.py").write_text(code)
    return root


def ops6k_jsonl(path: Path, codes: list[str], *, bad_rows: bool = True) -> Path:
    rows: list[Any] = [{"ops": str(["torch.relu"]), "data_source": "ops6k/torch", "code": c}
                       for c in codes]
    if bad_rows:
        rows += [{"ops": "[]", "data_source": "ops6k/torch"},  # no code
                 {"ops": "[]", "data_source": "ops6k/torch", "code": "x = 1\n"},  # not a task
                 {"ops": "[]", "data_source": "", "code": codes[0]}]  # a duplicate
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path: str | Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# --- prepare -------------------------------------------------------------------------------


def test_folder_gives_both_sets_with_verl_columns(folder: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    manifest = data.prepare(folder, out, device="cpu")
    assert manifest["counts"] == {"train": 2, "val": 1}  # 5% of 3, yet one to validate on
    assert json.loads((out / data.MANIFEST).read_text()) == manifest
    for kind, loop in [(data.AGENTIC, "cuda_agent"), (data.SINGLE_TURN, "single_turn_agent")]:
        for split in data.SPLITS:
            path = out / kind / f"{split}.parquet"
            assert pq.read_schema(path).equals(data.parquet_schema())
            rows = read(path)
            assert [r["extra_info"]["task_id"] for r in rows] == manifest["task_ids"][split]
            for row in rows:
                info = row["extra_info"]
                assert row["agent_name"] == loop and row["data_source"] == "cuda-agent/folder"
                assert row["reward_model"] == {"style": "rule", "ground_truth": info["task_id"]}
                assert info["task_id"] == compute_task_id(info["code"])
                assert info["device"] == "cpu" and info["split"] == split
                assert info["source"].endswith(f"{info['task_name']}.py")
    agentic = read(out / "agentic" / "train.parquet")[0]
    task = next(p.task for p in data.usable_tasks(folder)[0]
                if p.task.id == agentic["extra_info"]["task_id"])
    assert agentic["prompt"] == initial_messages(task, "cpu", skill_text(task, "cpu"))
    single = read(out / "single_turn" / "train.parquet")[0]
    system, user = single["prompt"]
    assert system["role"] == "system" and "load_inline" in system["content"]
    assert "cuda_sources" not in system["content"]  # the CPU flavour asks for C++ only
    assert user["role"] == "user" and single["extra_info"]["code"].rstrip() in user["content"]
    assert "```python" in user["content"]


def test_ops6k_rows_keep_their_source_and_count_what_was_skipped(tmp_path: Path) -> None:
    manifest = data.prepare(ops6k_jsonl(tmp_path / "ops.jsonl", CODES), tmp_path / "out")
    assert manifest["counts"]["train"] + manifest["counts"]["val"] == 4
    assert manifest["skipped"]["invalid"] == 2 and manifest["skipped"]["duplicate"] == 1
    assert len(manifest["skipped"]["rows"]) == 3
    assert all(r["reason"] for r in manifest["skipped"]["rows"])
    rows = read(tmp_path / "out" / "single_turn" / "train.parquet")
    assert {r["data_source"] for r in rows} == {"ops6k/torch"}
    assert {r["extra_info"]["device"] for r in rows} == {"cuda"}
    small = data.prepare(tmp_path / "ops.jsonl", tmp_path / "small", max_tasks=2)
    assert small["counts"]["train"] + small["counts"]["val"] == 2


def test_split_is_deterministic_by_task_id_and_disjoint(tmp_path: Path) -> None:
    many = [task_code(f"x * {k}.0", "torch.randn(4, 8)") for k in range(40)]
    a = data.prepare(ops6k_jsonl(tmp_path / "a.jsonl", many), tmp_path / "a", val_fraction=0.25)
    again = data.prepare(tmp_path / "a.jsonl", tmp_path / "again", val_fraction=0.25)
    shuffled = ops6k_jsonl(tmp_path / "b.jsonl", many[::-1], bad_rows=False)
    b = data.prepare(shuffled, tmp_path / "b", val_fraction=0.25)
    val = set(a["task_ids"]["val"])
    assert len(val) == 10 and not val & set(a["task_ids"]["train"])
    assert set(a["task_ids"]["train"]) | val == {compute_task_id(c) for c in many}
    assert a["task_ids"] == again["task_ids"]
    assert set(b["task_ids"]["val"]) == val  # the input's order does not matter
    other = data.prepare(tmp_path / "a.jsonl", tmp_path / "c", val_fraction=0.25, seed=1)
    assert set(other["task_ids"]["val"]) != val
    for kind in (data.AGENTIC, data.SINGLE_TURN):
        ids = {s: {r["extra_info"]["task_id"] for r in read(tmp_path / "a" / kind / f"{s}.parquet")}
               for s in data.SPLITS}
        assert ids["val"] == val and not ids["val"] & ids["train"]


def test_unusable_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ops": "[]", "data_source": "x", "code": "x = 1\n"}) + "\n")
    with pytest.raises(ValueError, match="no valid tasks"):
        data.prepare(bad, tmp_path / "out")
    with pytest.raises(ValueError, match="fraction"):
        data.prepare(ops6k_jsonl(tmp_path / "ok.jsonl", CODES), tmp_path / "out", val_fraction=1.0)


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer with a chat template, built here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CODES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def test_rows_read_back_unchanged_through_verls_dataset(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")

    out = tmp_path / "out"
    data.prepare(folder, out, device="cpu", val_fraction=0.0)
    tokenizer = tiny_tokenizer()
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 1_000_000,
                               "return_raw_chat": True, "cache_dir": str(tmp_path / "verl-cache"),
                               "filter_overlong_prompts_workers": 1})
    for kind in (data.AGENTIC, data.SINGLE_TURN):
        path = out / kind / "train.parquet"
        written = read(path)
        dataset = RLHFDataset(str(path), tokenizer, config)
        assert len(dataset) == len(written) == 3  # none dropped by the length filter
        for i, row in enumerate(written):
            item = dataset[i]
            assert [dict(m) for m in item["raw_prompt"]] == row["prompt"]
            assert item["extra_info"] == row["extra_info"]
            assert item["index"] == row["extra_info"]["index"]
            assert item["agent_name"] == row["agent_name"]
            assert item["data_source"] == row["data_source"]
            assert item["reward_model"]["ground_truth"] == row["extra_info"]["task_id"]
        text = tokenizer.apply_chat_template(written[0]["prompt"], tokenize=False)
        assert written[0]["prompt"][1]["content"] in text


def test_cli_prepare(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["rl", "prepare", str(folder), "--out", str(out), "--device", "cpu",
                 "--val-fraction", "0.5", "--seed", "3", "--max-tasks", "2"]) == 0
    manifest = json.loads((out / data.MANIFEST).read_text())
    assert manifest["counts"] == {"train": 1, "val": 1} and manifest["seed"] == 3
    assert "1 train and 1 val" in capsys.readouterr().out
    assert main(["rl", "prepare", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "does not exist" in err


# --- the single-turn reward ----------------------------------------------------------------

RELU_CPP = r'''
#include <algorithm>
torch::Tensor relu_fwd(torch::Tensor x) {
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "contiguous float32");
    auto y = torch::empty_like(x);
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    const int64_t n = x.numel();
    #pragma omp parallel for if (n > 65536)
    for (int64_t i = 0; i < n; ++i) out[i] = std::max(in[i], 0.0f);
    return y;
}
torch::Tensor relu_wrong(torch::Tensor x) {
    auto y = torch::empty_like(x);
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) out[i] = std::min(in[i], 0.0f);
    return y;
}
'''


def relu_solution(function: str) -> str:
    """A single-file CPU solution of RELU; both functions live in one extension (one build)."""
    return (
        "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
        f'relu_cpp = """{RELU_CPP}"""\n\n'
        'relu_ext = load_inline(name="rl_relu_ext", cpp_sources=relu_cpp,\n'
        '                       functions=["relu_fwd", "relu_wrong"], extra_cflags=["-O3"])\n\n\n'
        "class ModelNew(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n\n"
        f"    def forward(self, x):\n        return relu_ext.{function}(x)\n"
    )


def response(code: str) -> str:
    return ("<think>\n```python\nclass ModelNew: pass\n```\n</think>\nA first sketch:\n"
            "```python\nprint('not it')\n```\nThe kernel:\n```python\n" + code + "```\nDone.\n")


RELU_INFO = {"task_id": compute_task_id(RELU), "task_name": "relu", "code": RELU,
             "source": "test", "device": "cpu", "index": 0, "split": "train"}
QUICK = {"profile": False, "run_timeout_s": 120.0}  # speed is the evaluator's own tests' business


def test_the_kernel_is_the_last_python_block_defining_modelnew() -> None:
    code = relu_solution("relu_fwd")
    assert extract_model_new(response(code)) == code
    assert extract_model_new("```python\n" + code) is None  # unclosed: a truncated answer
    assert extract_model_new("```cpp\nclass ModelNew {};\n```\n") is None
    assert extract_model_new("<think>```python\nclass ModelNew: pass\n```</think>no code") is None


def verl_reward(response_text: str, **reward_kwargs: Any) -> dict[str, Any]:
    """The reward of one response through verl's own path: the custom reward function loaded
    from its config (`pkg://` path, reward_kwargs) by the naive reward manager, which decodes
    the response tokens and calls it as it does during training."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    config = OmegaConf.create({"reward": {
        "custom_reward_function": {"path": "pkg://cuda_agent.rl.reward", "name": "compute_score",
                                   "reward_kwargs": reward_kwargs},
        "reward_manager": {"source": "register", "name": "naive"},
    }})
    tokenizer = tiny_tokenizer()
    manager = load_reward_manager(config, tokenizer)
    prompt = tokenizer("Task relu", add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == response_text
    batch = TensorDict({
        "prompts": torch.tensor([prompt]), "responses": torch.tensor([response_ids]),
        "attention_mask": torch.ones(1, len(prompt) + len(response_ids), dtype=torch.int64),
    }, batch_size=1)
    row = {"data_source": "ops6k/torch", "extra_info": dict(RELU_INFO), "__num_turns__": 2,
           "reward_model": {"style": "rule", "ground_truth": RELU_INFO["task_id"]},
           "tool_extra_fields": {"turn_scores": [], "tool_rewards": []}}
    non_tensors = {k: np.array([v], dtype=object) for k, v in row.items()}
    item = DataProto(batch=batch, non_tensor_batch=non_tensors)
    out = manager.loop.run_until_complete(manager.run_single(item))
    assert out["reward_score"] == out["reward_extra_info"]["score"]
    return out["reward_extra_info"]


def test_a_response_without_code_scores_minus_one() -> None:
    score = verl_reward("I would write a kernel.", **QUICK)
    assert score["score"] == -1.0 and score["status"] == "no_code" and score["acc"] == 0.0
    assert "ModelNew" in score["message"]


def test_options_and_setup_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REWARD_ENV, raising=False)
    assert eval_options(RELU_INFO, {}).reward_name == "milestone"
    assert eval_options(RELU_INFO, {}).sandbox and eval_options(RELU_INFO, {}).device == "cpu"
    monkeypatch.setenv(REWARD_ENV, "speedup")
    assert eval_options(RELU_INFO, {}).reward_name == "speedup"
    assert eval_options(RELU_INFO, {"reward_name": "milestone"}).reward_name == "milestone"
    assert eval_options(RELU_INFO, {"reward_router_address": None}).trials == 5  # verl's own
    with pytest.raises(ValueError, match="no option"):
        compute_score("x", "", "", dict(RELU_INFO), reward="speedup")
    with pytest.raises(ValueError, match="extra_info.code"):
        compute_score("x", "", "", {"device": "cpu"})


def test_the_evaluators_reward_for_correct_and_wrong_kernels() -> None:
    good = verl_reward(response(relu_solution("relu_fwd")), **QUICK)
    assert good["status"] == "ok", good["message"]
    assert good["score"] == 1.0 and good["acc"] == 1.0  # correct, not timed: milestone 1
    wrong = compute_score("ops6k/torch", response(relu_solution("relu_wrong")),
                          RELU_INFO["task_id"], dict(RELU_INFO), **QUICK)
    assert wrong["score"] == -1.0 and wrong["status"] == "incorrect"
    assert set(good) == set(wrong)  # verl batches every sample by the first one's keys
