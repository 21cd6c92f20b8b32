"""Small questions about Python AST nodes, asked by the checker and the source extraction."""

from __future__ import annotations

import ast
from collections.abc import Collection

# Expressions that build a plain Python value, never a tensor.
LITERAL_NODES: tuple[type[ast.expr], ...] = (
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.JoinedStr,
)


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> fully qualified module or member, for every absolute import of the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def root_name(node: ast.expr) -> ast.Name | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def is_self_attr(node: ast.expr, attrs: Collection[str] | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (attrs is None or node.attr in attrs)
    )


def str_const(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def assigned_targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
    """(target, value) pairs of an assignment-like statement, tuples paired elementwise."""
    pairs: list[tuple[ast.expr, ast.expr | None]] = []

    def add(target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts, strict=True):
                    add(t, v)
            else:
                for t in target.elts:
                    add(t.value if isinstance(t, ast.Starred) else t, value)
        else:
            pairs.append((target, value))

    if isinstance(node, ast.Assign):
        for t in node.targets:
            add(t, node.value)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        add(node.target, node.value)
    elif isinstance(node, ast.NamedExpr):
        add(node.target, node.value)
    return pairs
