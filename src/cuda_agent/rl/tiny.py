"""A tiny model and tokenizer made here, from nothing downloaded: for tests and `rl smoke`.

The tokenizer is a byte-level BPE trained on the text an episode shows the model (SKILL.md,
the tool schemas, the task), with ChatML turn markers and a tool-calling chat template in
the Hermes format that `token_client.parse_tool_calls` reads, so verl's Qwen Continuous
Token builder handles it as it handles a Qwen-class coder. The model is a Qwen2 causal LM
with random weights. Neither is useful for anything but proving the pieces fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with the tool schemas in the system turn, tool calls as Hermes JSON blocks and
# consecutive tool results in one user turn.
CHAT_TEMPLATE = "".join(line.strip() for line in r"""
{%- if messages and messages[0].role == 'system' %}{% set sys = messages[0].content %}
  {%- set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}
{%- if sys or tools %}{{ '<|im_start|>system\n' + sys }}
  {%- if tools %}
    {{- '\n\n# Tools\nCall a tool with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>. The tools:' }}
    {%- for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}
  {%- endif %}{{ '<|im_end|>\n' }}
{%- endif %}
{%- for m in rest %}
  {%- if m.role == 'tool' %}
    {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}
    {%- if m.content %}{{ m.content }}{% endif %}
    {%- for c in (m.tool_calls or []) %}
      {{- '\n<tool_call>{"name": ' + (c.function.name | tojson) + ', "arguments": ' }}
      {%- if c.function.arguments is string %}{{ c.function.arguments }}
      {%- else %}{{ c.function.arguments | tojson }}{% endif %}{{ '}</tool_call>' }}
    {%- endfor %}{{ '<|im_end|>\n' }}
  {%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
""".splitlines())


def _corpus(device: str) -> list[str]:
    from cuda_agent.agent.tools import SCHEMAS
    from cuda_agent.paths import TEMPLATES

    texts = [(TEMPLATES / f"SKILL.{d}.md").read_text() for d in ("cuda", "cpu")]
    texts += [json.dumps(s) for s in SCHEMAS]
    for p in sorted((TEMPLATES / "utils").glob("*.py")):
        texts.append(p.read_text())
    texts.append("import torch\nimport torch.nn as nn\nclass Model(nn.Module):\n    def forward(self, x):\n"
                 "        return torch.relu(x)\ndef get_inputs():\n    return [torch.randn(16, 16)]\n")
    return texts


def tiny_tokenizer(vocab_size: int = 2048, device: str = "cuda") -> Any:
    """A `PreTrainedTokenizerFast` with the chat template above (about a second to train)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(device), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.add_tokens(MARKERS)  # whole tokens, but not special: decoding keeps them
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(tokenizer: Any, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Any:
    """A Qwen2 causal LM with random weights sized to `tokenizer` (about 0.3M parameters)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=65536, tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None)
    return Qwen2ForCausalLM(cfg).to(torch.float32)


def save(tokenizer: Any, model: Any, directory: str | Path) -> Path:
    """Both into `directory`, loadable with `from_pretrained` (as verl loads a model path)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(d)
    model.save_pretrained(d)
    return d
