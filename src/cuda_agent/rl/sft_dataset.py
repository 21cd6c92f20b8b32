"""`RFTDataset`: the RFT set (`cuda-agent rl rft-filter`) as verl's SFT trainer loads it.

    data.custom_cls.path=pkg://cuda_agent.rl.sft_dataset  data.custom_cls.name=RFTDataset

verl builds it as `cls(parquet_files=, tokenizer=, config=data, processor=, max_samples=)`
and batches its items with `SFTTensorCollator`; an item is what verl's own
`MultiTurnSFTDataset` returns: `input_ids`, `position_ids`, `loss_mask` (1 on the tokens
trained on), and `attention_mask` under `data.pad_mode=right` (padded to `data.max_length`).

A row is one of two kinds (column `kind`):

- `tokens`: the episode's exact ids and mask, from verl's rollout: returned as stored.
- `messages`: the conversation and tool schemas as JSON strings, tokenised here with the
  tokenizer's chat template (`encode_conversation`): the whole conversation is rendered
  once, and the loss covers the assistant turns' characters, found by rendering the
  conversation up to each assistant turn. Rendering message by message (verl's way)
  disagrees with the whole conversation where a template groups consecutive tool
  messages into one turn; this does not.

Too long for `data.max_length`: `data.truncation=error` (verl's default) raises (token rows
when the dataset is built, messages rows when first read: `rft-filter --tokenizer` reports
the longest row beforehand), `drop` leaves the row out (messages rows are then all tokenised
when the dataset is built). Cutting would lose the end of an episode, where its reward was
earned, so `left` and `right` are refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from cuda_agent.rl.rft import KIND_MESSAGES, KIND_TOKENS

TRUNCATIONS = ("error", "drop")
PAD_MODES = ("right", "no_padding")


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None, text: str,
                    **template_kwargs: Any) -> list[tuple[int, int]]:
    """Character spans of `text` (the whole conversation rendered) that the assistant
    turns produced: from the end of the generation prompt before each assistant message to
    the end of that message's rendering, less trailing whitespace (the template's newline
    after the end-of-turn token)."""
    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt,
                                             **template_kwargs)

    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(before) and text.startswith(through)
                and len(through) > len(before)):
            raise ValueError(f"the chat template does not render the conversation up to message "
                             f"{i} as the start of the whole one, so its assistant turns cannot "
                             "be found; train on token rows (episodes with tokens.json) instead")
        end = len(through)
        while end > len(before) and through[end - 1].isspace():
            end -= 1
        spans.append((len(before), end))
    return spans


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None,
                        **template_kwargs: Any) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation (as `apply_chat_template(..., tokenize=True)`
    gives them) and a loss mask that is 1 on every token holding a character of an
    assistant turn (its text, tool calls and end-of-turn token)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("messages rows need a fast (Rust) tokenizer: its character offsets place "
                         "the assistant turns")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=False, **template_kwargs)
    spans = assistant_spans(tokenizer, messages, tools, text, **template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    k = 0
    for t, (start, end) in enumerate(offsets):
        end = max(end, start + 1)  # a token with no width counts where it stands
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k < len(spans) and start < spans[k][1] and end > spans[k][0]:
            mask[t] = 1
    return ids, mask


def _as_list(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    return [str(f) for f in files]


class RFTDataset(Dataset):
    """The RFT parquet file(s) for verl's SFT trainer (see the module docstring)."""

    def __init__(self, parquet_files: str | Sequence[str], tokenizer: Any, config: Any = None,
                 processor: Any = None, max_samples: int = -1) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        config = config if config is not None else {}
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.pad_mode = str(config.get("pad_mode", "right"))
        self.truncation = str(config.get("truncation", "error"))
        self.max_length = int(config.get("max_length", 1024))
        self.messages_key = config.get("messages_key", "messages")
        self.tools_key = config.get("tools_key", "tools")
        self.template_kwargs = dict(config.get("apply_chat_template_kwargs", None) or {})
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"data.pad_mode={self.pad_mode} is not supported; use "
                             f"{' or '.join(PAD_MODES)}")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={self.truncation} would cut an episode (and the "
                             f"loss at its end); use {' or '.join(TRUNCATIONS)}")
        self.files = _as_list(parquet_files)
        self.table = pa.concat_tables([pq.read_table(f) for f in self.files],
                                      promote_options="default")
        for col in ("kind", "input_ids", "loss_mask"):
            if col not in self.table.column_names:
                raise ValueError(f"{', '.join(self.files)} has no column {col!r}: not an RFT set "
                                 "from `cuda-agent rl rft-filter`")
        rows = list(range(self.table.num_rows))
        if 0 < max_samples < len(rows):
            if config.get("shuffle", False):
                import numpy as np

                rng = np.random.default_rng(config.get("seed"))
                rows = sorted(rng.choice(len(rows), size=max_samples, replace=False).tolist())
            else:
                rows = rows[:max_samples]
        kinds = self.table.column("kind").to_pylist()
        lengths = pc.list_value_length(self.table.column("input_ids")).to_pylist()
        ids = pc.list_flatten(self.table.column("input_ids"))
        top = pc.max(ids).as_py() if len(ids) else None
        if top is not None and top >= len(tokenizer):
            raise ValueError(f"token rows hold id {top}, outside the tokenizer's {len(tokenizer)} "
                             "ids: they were made with another tokenizer than model.path's")
        if self.truncation == "drop":  # a messages row's length is known once tokenised
            lengths = [len(self._encode_messages(i)[0]) if kinds[i] == KIND_MESSAGES else lengths[i]
                       for i in range(len(kinds))]
        too_long = [i for i in rows if lengths[i] is not None and lengths[i] > self.max_length]
        if too_long and self.truncation == "error":
            longest = max(lengths[i] for i in too_long)
            raise ValueError(f"{len(too_long)} token row(s) are longer than data.max_length="
                             f"{self.max_length} (the longest {longest}): raise it, or set "
                             "data.truncation=drop to leave them out")
        if too_long:
            print(f"RFTDataset: dropped {len(too_long)} of {len(rows)} rows longer than "
                  f"data.max_length={self.max_length}")
        dropped = set(too_long)
        self.rows = [i for i in rows if i not in dropped]
        self.kinds = kinds

    def __len__(self) -> int:
        return len(self.rows)

    def _cell(self, column: str, i: int) -> Any:
        return self.table.column(column)[i].as_py()

    def _ids(self, column: str, i: int) -> torch.Tensor:
        return torch.tensor(self.table.column(column)[i].values.to_numpy(), dtype=torch.long)

    def _encode_messages(self, i: int) -> tuple[list[int], list[int]]:
        messages = json.loads(self._cell(self.messages_key, i))
        has_tools = self.tools_key in self.table.column_names
        tools_json = self._cell(self.tools_key, i) if has_tools else None
        tools = json.loads(tools_json) if tools_json else None
        return encode_conversation(self.tokenizer, messages, tools, **self.template_kwargs)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        i = self.rows[item]
        if self.kinds[i] == KIND_TOKENS:
            input_ids = self._ids("input_ids", i)
            loss_mask = self._ids("loss_mask", i)
        elif self.kinds[i] == KIND_MESSAGES:
            ids, mask = self._encode_messages(i)
            input_ids = torch.tensor(ids, dtype=torch.long)
            loss_mask = torch.tensor(mask, dtype=torch.long)
        else:
            raise ValueError(f"row {i} has an unknown kind {self.kinds[i]!r}")
        n = int(input_ids.shape[0])
        if n > self.max_length:
            raise ValueError(f"row {i} is {n} tokens, longer than data.max_length="
                             f"{self.max_length}: raise it, or set data.truncation=drop")
        position_ids = torch.arange(n, dtype=torch.long)
        if self.pad_mode == "no_padding":
            return {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask}
        pad = torch.zeros(self.max_length - n, dtype=torch.long)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return {"input_ids": torch.cat([input_ids, pad + pad_id]),
                "attention_mask": torch.cat([torch.ones(n, dtype=torch.long), pad]),
                "position_ids": torch.cat([position_ids, pad]),
                "loss_mask": torch.cat([loss_mask, pad])}
