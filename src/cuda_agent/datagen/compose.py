"""Composers: operators stacked into one KernelBench-format task.

The offline composer samples the number of operators from a mix (default: the published
CUDA-Agent-Ops-6K distribution), a starting input (2-D features, or 1-D/2-D/3-D spatial
maps with channels), then operators one by one from those that accept the current rank,
with shape-consistent sizes, and writes code that reads like a hand-written task:
named sizes at module level, constructor arguments in `get_init_inputs()`.

The LLM composer asks an OpenAI-compatible model to compose given operators into a task;
its code is parsed and validated like any task file, and then filtered like any other
(never trusted).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuda_agent.datagen.catalog import Op, Shape, usable

# Share of tasks by number of operators in CUDA-Agent-Ops-6K; "transformers": standalone modules.
PUBLISHED_MIX: dict[int | str, float] = {1: 0.0340, 2: 0.8377, 3: 0.0762, 4: 0.0280, 5: 0.0123,
                                         "transformers": 0.0118}

_STARTS: dict[int, tuple[list[str], list[list[int]]]] = {
    2: (["batch_size", "in_features"], [[64, 128, 256, 512], [512, 1024, 2048, 4096]]),
    3: (["batch_size", "in_channels", "length"], [[16, 32, 64], [8, 16, 32, 64], [256, 512, 1024, 2048]]),
    4: (["batch_size", "in_channels", "height", "width"], [[8, 16, 32], [3, 8, 16, 32], [32, 64, 128], []]),
    5: (["batch_size", "in_channels", "depth", "height", "width"], [[4, 8], [3, 8, 16], [8, 16], [32, 64], []]),
}
_RANK_WEIGHTS = {2: 0.3, 3: 0.15, 4: 0.4, 5: 0.15}


@dataclass
class Composed:
    code: str
    ops: list[str]
    n_ops: int
    data_source: str
    composer: str


def transformers_modules() -> list[tuple[str, str, str]]:
    """(name, import line, constructor) of standalone `transformers` modules, if installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    out = []
    for name, mod, ctor in [("LlamaRMSNorm", "transformers.models.llama.modeling_llama", "LlamaRMSNorm(hidden_size)"),
                            ("T5LayerNorm", "transformers.models.t5.modeling_t5", "T5LayerNorm(hidden_size)")]:
        try:
            __import__(mod, fromlist=[name])
        except Exception:
            continue
        out.append((name, f"from {mod} import {name}", ctor))
    return out


def normalised_mix(mix: dict[int | str, float]) -> dict[int | str, float]:
    m = {k: v for k, v in mix.items() if v > 0 and (k != "transformers" or transformers_modules())}
    total = sum(m.values())
    if not m or total <= 0:
        raise ValueError("the operator-count mix has no usable entry")
    return {k: v / total for k, v in m.items()}


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        taken.add(name)
        return name
    k = 2
    while f"{name}_{k}" in taken:
        k += 1
    taken.add(f"{name}_{k}")
    return f"{name}_{k}"


def _scaled(v: int, scale: float, name: str) -> int:
    """Input sizes times `scale` (small tasks for CPU runs); channel counts stay."""
    if name in ("in_channels",) or scale == 1.0:
        return v
    return max(4, int(round(v * scale)))


def compose_offline(rng: random.Random, n_ops: int, *, ops: Sequence[Op] | None = None, scale: float = 1.0,
                    tries: int = 50) -> Composed | None:
    """One task of `n_ops` operators, or None if no consistent chain was found."""
    pool = list(ops or usable())
    for _ in range(tries):
        rank = rng.choices(list(_RANK_WEIGHTS), weights=list(_RANK_WEIGHTS.values()))[0]
        names, choices = _STARTS[rank]
        values = [rng.choice(c) if c else 0 for c in choices]
        if rank >= 4:
            values[-1] = values[-2]  # square maps
        values = [_scaled(v, scale, n) for v, n in zip(values, names, strict=True)]
        shape: Shape = tuple(values)
        consts: dict[str, int] = dict(zip(names, values, strict=True))
        taken = set(consts) | {"x", "self", "torch", "nn"}
        dims = {"channels": "{in_features}" if rank == 2 else "{in_channels}",
                "features": "{in_features}" if rank == 2 else str(shape[-1])}
        attrs: set[str] = set()
        inits: list[tuple[str, str]] = []
        forwards: list[str] = []
        used: list[str] = []
        ok = True
        for _k in range(n_ops):
            cands = _ordered_candidates(rng, [o for o in pool if len(shape) in o.ranks and
                                              (not used or o.name != used[-1])])
            use = None
            for op in cands[:12]:
                use = op.make(shape, rng, dims)
                if use is not None:
                    break
            if use is None:
                ok = False
                break
            rename = {k: _unique(k, taken) for k in use.sizes}
            for k, new in rename.items():
                consts[new] = use.sizes[k]
            fmt = {**{k: k for k in consts}, **{"_" + k: v for k, v in rename.items()}}
            attr = _unique(use.attr, attrs) if use.attr else ""
            if use.init:
                inits.append((attr, use.init.format(**fmt)))
            forwards.append(use.forward.format(attr=attr))
            used.append(op.name)
            new_shape = use.out_shape
            if "out_features" in rename:
                dims["channels"] = dims["features"] = "{" + rename["out_features"] + "}"
            elif "out_channels" in rename:
                dims["channels"], dims["features"] = "{" + rename["out_channels"] + "}", str(new_shape[-1])
            else:
                same = len(new_shape) == len(shape) and new_shape[1] == shape[1]
                dims["channels"] = dims["channels"] if same else str(new_shape[1])
                dims["features"] = dims["channels"] if len(new_shape) == 2 else str(new_shape[-1])
            shape = new_shape
            if any(s <= 0 for s in shape) or _numel(shape) > 1 << 28:
                ok = False
                break
        if ok:
            return Composed(code=_render(used, inits, forwards, consts, names, rank), ops=used, n_ops=n_ops,
                            data_source=f"torch#{n_ops}", composer="offline")
    return None


# How often each kind of operator is drawn (then one of its operators, uniformly): the
# introspected activations alone would otherwise outnumber everything else.
CATEGORY_WEIGHTS = {"activation": 0.25, "convolution": 0.2, "matmul": 0.12, "normalisation": 0.15,
                    "pooling": 0.1, "reduction": 0.07, "softmax": 0.05, "elementwise": 0.04, "shape": 0.02}


def _ordered_candidates(rng: random.Random, cands: list[Op]) -> list[Op]:
    """Candidates in the order to try: categories drawn by weight, operators shuffled within."""
    by: dict[str, list[Op]] = {}
    for o in cands:
        by.setdefault(o.category, []).append(o)
    out: list[Op] = []
    while by:
        cats = list(by)
        cat = rng.choices(cats, weights=[CATEGORY_WEIGHTS.get(c, 0.02) for c in cats])[0]
        group = by.pop(cat)
        rng.shuffle(group)
        out += group[:3]
    return out


def compose_transformers(rng: random.Random, scale: float = 1.0) -> Composed | None:
    mods = transformers_modules()
    if not mods:
        return None
    name, imp, ctor = rng.choice(mods)
    hidden = _scaled(rng.choice([1024, 2048, 4096]), scale, "hidden_size")
    batch, seq = _scaled(rng.choice([8, 16]), scale, "batch_size"), _scaled(rng.choice([256, 512, 1024]), scale, "s")
    code = (f"import torch\nimport torch.nn as nn\n{imp}\n\n\nclass Model(nn.Module):\n"
            f'    """{name} from transformers."""\n\n    def __init__(self, hidden_size):\n        super().__init__()\n'
            f"        self.norm = {ctor}\n\n    def forward(self, x):\n        return self.norm(x)\n\n\n"
            f"batch_size = {batch}\nseq_len = {seq}\nhidden_size = {hidden}\n\n\ndef get_inputs():\n"
            "    return [torch.randn(batch_size, seq_len, hidden_size)]\n\n\ndef get_init_inputs():\n"
            "    return [hidden_size]\n")
    return Composed(code=code, ops=[name], n_ops=1, data_source="transformers#1", composer="offline")


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _render(ops: list[str], inits: list[tuple[str, str]], forwards: list[str], consts: dict[str, int],
            input_names: list[str], rank: int) -> str:
    init_args: list[str] = []
    for _, expr in inits:
        for name in re.findall(r"\b[a-z_][a-z0-9_]*\b", expr):
            if name in consts and name not in init_args and not expr.startswith(f"nn.{name}"):
                init_args.append(name)
    what = ops[0] if len(ops) == 1 else ", ".join(ops[:-1]) + f" and {ops[-1]}"
    lines = ["import torch", "import torch.nn as nn", "", "", "class Model(nn.Module):",
             f'    """Applies {what}{" in sequence" if len(ops) > 1 else ""}."""', "",
             f"    def __init__(self{''.join(', ' + a for a in init_args)}):", "        super().__init__()"]
    lines += [f"        self.{attr} = {expr}" for attr, expr in inits]
    lines += ["", "    def forward(self, x):"]
    lines += [f"        {f}" for f in forwards]
    lines += ["        return x", "", ""]
    lines += [f"{k} = {v}" for k, v in consts.items() if k in input_names or k in init_args]
    shape_args = ", ".join(input_names)
    lines += ["", "", "def get_inputs():", f"    return [torch.randn({shape_args})]", "", "",
              "def get_init_inputs():", f"    return [{', '.join(init_args)}]", ""]
    return "\n".join(lines)


def sample_n_ops(rng: random.Random, mix: dict[int | str, float]) -> int | str:
    keys = list(mix)
    return rng.choices(keys, weights=[mix[k] for k in keys])[0]


# --------------------------------------------------------------------------- LLM composer

LLM_PROMPT = """Write a PyTorch task file in KernelBench format that composes these operators, applied in \
sequence in one module: {ops}.

Rules: define `class Model(nn.Module)` whose `__init__` takes the sizes it needs and whose `forward` applies \
the operators in that order; define module-level sizes, `get_inputs()` returning a list of random input tensors \
(torch.randn) and `get_init_inputs()` returning the constructor arguments. Shapes must be consistent. \
No randomness inside the model (no dropout), no in-place ops, no prints. Reply with one ```python code block."""


def extract_code(reply: str) -> str | None:
    m = re.search(r"```(?:python|py)?\s*\n(.*?)```", reply, re.S)
    code = m.group(1) if m else reply
    return code if "class Model" in code else None


async def compose_llm(client: Any, rng: random.Random, n_ops: int, ops: Sequence[Op] | None = None) -> Composed | None:
    """Ask the model for a task composing `n_ops` sampled operator names; None if its reply has no task."""
    pool = list(ops or usable())
    names = [o.name for o in rng.sample(pool, k=min(n_ops, len(pool)))]
    c = await client.complete([{"role": "user", "content": LLM_PROMPT.format(ops=", ".join(names))}], [])
    code = extract_code(c.content or "")
    if code is None:
        return None
    return Composed(code=code, ops=names, n_ops=n_ops, data_source=f"llm#{n_ops}", composer="llm")
