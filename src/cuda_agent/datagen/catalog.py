"""The operator catalogue: what can appear in a synthesized task, and how.

Each `Op` says which input ranks it accepts, how to construct it (an `nn` module built in
`__init__`, or a function applied in `forward`), how the output shape follows from the
input shape, and whether it is stochastic (excluded from tasks) or in-place. Parameterless
elementwise activations are found by introspecting `torch.nn` (every activation module
whose constructor needs no argument); the rest is curated.

An op's `make(shape, pick)` returns an `OpUse`: the module line for `__init__` (if any),
the `forward` line, the output shape, and the named sizes it introduces (constructor
arguments go to `get_init_inputs`). `dims` holds how the current channel dimension
(`channels`, dim 1) and last dimension (`features`) are written: a size placeholder such as
`{in_channels}`, or a literal.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field

Shape = tuple[int, ...]


@dataclass
class OpUse:
    init: str | None  # e.g. "nn.Conv2d({in_channels}, {_out_channels}, {_kernel_size})": {_x} is this op's own size x
    forward: str  # e.g. "x = self.{attr}(x)" or "x = torch.relu(x)"
    out_shape: Shape
    sizes: dict[str, int] = field(default_factory=dict)  # new named sizes (constructor arguments)
    attr: str = ""


@dataclass
class Op:
    name: str
    category: str
    ranks: tuple[int, ...]
    make: Callable[[Shape, random.Random, dict[str, str]], OpUse | None]
    stochastic: bool = False
    inplace: bool = False
    source: str = "curated"  # or "introspected"


def _mod(cls: str, attr: str, args: str = "") -> Callable[[Shape, random.Random, dict[str, str]], OpUse]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
        return OpUse(init=f"nn.{cls}({args})", forward="x = self.{attr}(x)", out_shape=shape, attr=attr)
    return make


def _fn(expr: str, shape_fn: Callable[[Shape], Shape] | None = None) -> Callable[..., OpUse]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
        return OpUse(init=None, forward=f"x = {expr}", out_shape=shape_fn(shape) if shape_fn else shape)
    return make


def _linear(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
    out = rng.choice([256, 512, 1024, 2048])
    return OpUse(init=f"nn.Linear({dims['features']}, {{_out_features}})", forward="x = self.{attr}(x)",
                 out_shape=(*shape[:-1], out), sizes={"out_features": out}, attr="linear")


def _conv(nd: int) -> Callable[..., OpUse | None]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse | None:
        k = rng.choice([1, 3, 5]) if nd < 3 else rng.choice([1, 3])
        out = rng.choice([16, 32, 64, 128])
        spatial = shape[2:]
        if any(s < k for s in spatial):
            return None
        new = tuple(s - k + 1 for s in spatial)
        return OpUse(init=f"nn.Conv{nd}d({dims['channels']}, {{_out_channels}}, {{_kernel_size}})",
                     forward="x = self.{attr}(x)", out_shape=(shape[0], out, *new),
                     sizes={"out_channels": out, "kernel_size": k}, attr="conv")
    return make


def _conv_transpose(nd: int) -> Callable[..., OpUse | None]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse | None:
        k, stride = rng.choice([2, 3, 4]), rng.choice([1, 2])
        out = rng.choice([16, 32, 64])
        new = tuple((s - 1) * stride + k for s in shape[2:])
        if any(s > 512 for s in new):
            return None
        return OpUse(init=f"nn.ConvTranspose{nd}d({dims['channels']}, {{_out_channels}}, {{_kernel_size}}, "
                     "stride={_stride})", forward="x = self.{attr}(x)", out_shape=(shape[0], out, *new),
                     sizes={"out_channels": out, "kernel_size": k, "stride": stride}, attr="conv_transpose")
    return make


def _norm(cls: str, attr: str) -> Callable[..., OpUse]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
        return OpUse(init=f"nn.{cls}({dims['channels']})", forward="x = self.{attr}(x)", out_shape=shape,
                     attr=attr)
    return make


def _group_norm(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse | None:
    groups = [g for g in (2, 4, 8, 16) if shape[1] % g == 0]
    if not groups:
        return None
    g = rng.choice(groups)
    return OpUse(init=f"nn.GroupNorm({{_num_groups}}, {dims['channels']})", forward="x = self.{attr}(x)",
                 out_shape=shape, sizes={"num_groups": g}, attr="group_norm")


def _layer_norm(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
    return OpUse(init=f"nn.LayerNorm({dims['features']})", forward="x = self.{attr}(x)", out_shape=shape,
                 attr="layer_norm")


def _pool(kind: str, nd: int) -> Callable[..., OpUse | None]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse | None:
        k = 2
        if any(s < 2 * k for s in shape[2:]):
            return None
        return OpUse(init=f"nn.{kind}Pool{nd}d(kernel_size={k})", forward="x = self.{attr}(x)",
                     out_shape=(*shape[:2], *(s // k for s in shape[2:])), attr=f"{kind.lower()}_pool")
    return make


def _adaptive_avg(nd: int) -> Callable[..., OpUse]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
        return OpUse(init=f"nn.AdaptiveAvgPool{nd}d(1)", forward="x = self.{attr}(x)",
                     out_shape=(*shape[:2], *(1 for _ in shape[2:])), attr="adaptive_pool")
    return make


def _reduce(fn: str) -> Callable[..., OpUse]:
    def make(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
        return OpUse(init=None, forward=f"x = torch.{fn}(x, dim=1, keepdim=True)",
                     out_shape=(shape[0], 1, *shape[2:]))
    return make


def _softmax(fn: str) -> Callable[..., OpUse]:
    return _fn(f"torch.{fn}(x, dim=1)")


def _flatten(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
    n = 1
    for s in shape[1:]:
        n *= s
    return OpUse(init=None, forward="x = torch.flatten(x, 1)", out_shape=(shape[0], n))


def _scale(shape: Shape, rng: random.Random, dims: dict[str, str]) -> OpUse:
    c = rng.choice([0.5, 2.0, 1.5, 0.1])
    return OpUse(init=None, forward=f"x = x * {c}", out_shape=shape)


# Not elementwise, need arguments, or random: handled elsewhere or never used.
_NOT_ELEMENTWISE = {"GLU", "LogSoftmax", "Softmax", "Softmax2d", "Softmin", "MultiheadAttention", "Threshold"}
STOCHASTIC = {"RReLU", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"}


def introspected_activations() -> list[Op]:
    """Every `torch.nn` activation module constructible without arguments, as an elementwise op."""
    import torch.nn as nn

    out = []
    for name in sorted(dir(nn.modules.activation)):
        cls = getattr(nn.modules.activation, name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == "torch.nn.modules.activation"):
            continue
        if name in _NOT_ELEMENTWISE:
            continue
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            continue
        attr = name.lower()
        out.append(Op(name, "activation", (2, 3, 4, 5), _mod(name, attr), stochastic=name in STOCHASTIC,
                      source="introspected"))
    return out


def curated() -> list[Op]:
    ops = [
        Op("Linear", "matmul", (2,), _linear),
        Op("Conv1d", "convolution", (3,), _conv(1)),
        Op("Conv2d", "convolution", (4,), _conv(2)),
        Op("Conv3d", "convolution", (5,), _conv(3)),
        Op("ConvTranspose1d", "convolution", (3,), _conv_transpose(1)),
        Op("ConvTranspose2d", "convolution", (4,), _conv_transpose(2)),
        Op("ConvTranspose3d", "convolution", (5,), _conv_transpose(3)),
        Op("BatchNorm1d", "normalisation", (2, 3), _norm("BatchNorm1d", "batch_norm")),
        Op("BatchNorm2d", "normalisation", (4,), _norm("BatchNorm2d", "batch_norm")),
        Op("BatchNorm3d", "normalisation", (5,), _norm("BatchNorm3d", "batch_norm")),
        Op("InstanceNorm2d", "normalisation", (4,), _norm("InstanceNorm2d", "instance_norm")),
        Op("GroupNorm", "normalisation", (3, 4, 5), _group_norm),
        Op("LayerNorm", "normalisation", (2,), _layer_norm),
        Op("MaxPool1d", "pooling", (3,), _pool("Max", 1)),
        Op("MaxPool2d", "pooling", (4,), _pool("Max", 2)),
        Op("MaxPool3d", "pooling", (5,), _pool("Max", 3)),
        Op("AvgPool2d", "pooling", (4,), _pool("Avg", 2)),
        Op("AvgPool3d", "pooling", (5,), _pool("Avg", 3)),
        Op("AdaptiveAvgPool2d", "pooling", (4,), _adaptive_avg(2)),
        Op("softmax", "softmax", (2, 3, 4), _softmax("softmax")),
        Op("log_softmax", "softmax", (2, 3, 4), _softmax("log_softmax")),
        Op("sum", "reduction", (2, 3, 4, 5), _reduce("sum")),
        Op("mean", "reduction", (2, 3, 4, 5), _reduce("mean")),
        Op("amax", "reduction", (2, 3, 4, 5), _reduce("amax")),
        Op("logsumexp", "reduction", (2, 3, 4, 5), _reduce("logsumexp")),
        Op("flatten", "shape", (3, 4, 5), _flatten),
        Op("scale", "elementwise", (2, 3, 4, 5), _scale),
        Op("clamp", "elementwise", (2, 3, 4, 5), _fn("torch.clamp(x, min=-1.0, max=1.0)")),
        Op("abs", "elementwise", (2, 3, 4, 5), _fn("torch.abs(x)")),
        Op("Dropout", "stochastic", (2, 3, 4, 5), _mod("Dropout", "dropout", "p=0.1"), stochastic=True),
    ]
    return ops


def catalogue() -> list[Op]:
    """All ops, stochastic ones included (marked): callers filter on `stochastic`."""
    seen: set[str] = set()
    out = []
    for op in [*curated(), *introspected_activations()]:
        if op.name not in seen:
            seen.add(op.name)
            out.append(op)
    return out


def usable(ops: list[Op] | None = None) -> list[Op]:
    return [o for o in (ops or catalogue()) if not o.stochastic and not o.inplace]
