"""AST similarity of two tasks' `Model` classes, for decontamination.

Each `Model` class is turned into a sequence of tokens by a pre-order walk of its AST:
the node type of every node, with names made anonymous (variables, arguments and
attributes of `self` become placeholders numbered by first appearance), constants
reduced to their type, docstrings dropped, but the names of what is called through a
module (`nn.Conv2d`, `torch.relu`, `F.gelu`) kept, since they say which operators the
model uses. Similarity is the Dice coefficient of the two multisets of token 4-grams:
2|A ∩ B| / (|A| + |B|), 1.0 for identical token sequences (a renamed copy), near 0 for
unrelated models. Tasks above a threshold (default 0.9) count as copies.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass

N = 4


def model_class(code: str) -> ast.ClassDef | None:
    """The `class Model` at the top level of a task's code, or None (also for a syntax error)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            return node
    return None


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in ("torch", "nn", "F", "functional", "math"):
        return ".".join([node.id, *reversed(parts)])
    return None


def tokens(code: str) -> list[str]:
    cls = model_class(code)
    if cls is None:
        return []
    names: dict[str, str] = {}

    def anon(name: str) -> str:
        if name not in names:
            names[name] = f"v{len(names)}"
        return names[name]

    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        if dotted:
            out.append(f"op:{dotted}")
            return
        label = type(node).__name__
        if isinstance(node, ast.Name):
            label += ":" + (node.id if node.id in ("self", "super") else anon(node.id))
        elif isinstance(node, ast.Attribute):
            label += ":" + (node.attr if not (isinstance(node.value, ast.Name) and node.value.id == "self")
                            else anon("self." + node.attr))
        elif isinstance(node, ast.arg):
            label += ":" + (node.arg if node.arg == "self" else anon(node.arg))
        elif isinstance(node, ast.Constant):
            label += ":" + type(node.value).__name__
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            label += ":" + (node.name if node.name in ("__init__", "forward", "Model") else anon(node.name))
        elif isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare)):
            op = getattr(node, "op", None) or (node.ops[0] if isinstance(node, ast.Compare) else None)
            label += ":" + type(op).__name__
        elif isinstance(node, ast.keyword):
            label += ":" + str(node.arg)
        out.append(label)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)):
                continue
            visit(child)

    visit(cls)
    return out


def shingles(code: str) -> Counter[tuple[str, ...]]:
    t = tokens(code)
    if len(t) < N:
        return Counter([tuple(t)]) if t else Counter()
    return Counter(tuple(t[i:i + N]) for i in range(len(t) - N + 1))


def dice(a: Counter[tuple[str, ...]], b: Counter[tuple[str, ...]]) -> float:
    total = sum(a.values()) + sum(b.values())
    if total == 0:
        return 0.0
    return 2 * sum((a & b).values()) / total


def similarity(code_a: str, code_b: str) -> float:
    return dice(shingles(code_a), shingles(code_b))


@dataclass
class Reference:
    """A benchmark's tasks, pre-shingled, to check many candidates against."""

    names: list[str]
    shingles: list[Counter[tuple[str, ...]]]

    @classmethod
    def from_codes(cls, items: list[tuple[str, str]]) -> Reference:
        return cls([n for n, _ in items], [shingles(c) for _, c in items])

    def closest(self, code: str) -> tuple[float, str | None]:
        s = shingles(code)
        best, name = 0.0, None
        for n, ref in zip(self.names, self.shingles, strict=True):
            d = dice(s, ref)
            if d > best:
                best, name = d, n
        return best, name
