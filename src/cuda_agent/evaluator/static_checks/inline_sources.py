"""The C++ a single-file solution hands to ``load_inline``, recovered from its AST.

The C++ rules run on these strings as on kernel files; each line of the text maps back to
the ``model_new.py`` line that holds it, so violations point into the Python file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from cuda_agent.evaluator.static_checks.ast_helpers import import_aliases
from cuda_agent.evaluator.static_checks.vocabulary import LOAD_INLINE


@dataclass(frozen=True)
class InlineSource:
    """C++ text passed to ``load_inline`` in a single-file solution.

    ``line_map[i]`` is the ``model_new.py`` line holding line ``i + 1`` of ``text``.
    """

    kind: str  # "cpp_sources" or "cuda_sources"
    text: str
    line_map: tuple[int, ...]

    def python_line(self, line: int) -> int:
        if not self.line_map:
            return 0
        return self.line_map[min(max(line, 1), len(self.line_map)) - 1]


_Piece = tuple[str, int, bool]  # text, first python line, whether lines map one to one


def extract_inline_sources(source: str) -> list[InlineSource]:
    """C++ strings passed as ``cpp_sources``/``cuda_sources`` to ``load_inline``.

    Follows string literals, implicit and ``+`` concatenation, f-strings (formatted parts
    become ``0``), lists (joined with newlines as load_inline does), ``.format``/``.strip``
    style calls on strings, and module-level ``NAME = ...`` / ``NAME += ...`` constants.
    Unresolvable arguments are skipped (the runtime build still sees them).
    """
    try:
        return _extract_inline_sources(source, ast.parse(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []


def _extract_inline_sources(source: str, tree: ast.Module) -> list[InlineSource]:
    aliases = import_aliases(tree)
    consts: dict[str, list[ast.expr]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    consts[t.id] = [stmt.value]
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            consts[stmt.target.id] = [stmt.value]
        elif (
            isinstance(stmt, ast.AugAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(stmt.op, ast.Add)
            and stmt.target.id in consts
        ):
            consts[stmt.target.id].append(stmt.value)

    def dotted(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def exact(node: ast.expr, value: str) -> bool:
        raw = ast.get_source_segment(source, node) or ""
        return raw.count("\n") == value.count("\n")

    def pieces(node: ast.expr, depth: int = 0) -> list[_Piece] | None:
        if depth > 20:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [(node.value, node.lineno, exact(node, node.value))]
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "0"
                for v in node.values
            )
            return [(text, node.lineno, exact(node, text))]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = pieces(node.left, depth + 1), pieces(node.right, depth + 1)
            return left + right if left is not None and right is not None else None
        if isinstance(node, ast.Name) and node.id in consts:
            out: list[_Piece] = []
            for expr in consts[node.id]:
                part = pieces(expr, depth + 1)
                if part is None:
                    return None
                out += part
            return out
        if isinstance(node, (ast.List, ast.Tuple)):
            out = []
            for i, elt in enumerate(node.elts):
                part = pieces(elt, depth + 1)
                if part is None:
                    return None
                if i:
                    out.append(("\n", out[-1][1] if out else node.lineno, False))
                out += part
            return out
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in (
                "format",
                "strip",
                "lstrip",
                "rstrip",
                "replace",
            ):
                return pieces(func.value, depth + 1)
            if len(node.args) == 1 and not node.keywords:
                return pieces(node.args[0], depth + 1)  # e.g. textwrap.dedent(SRC)
        return None

    found: list[InlineSource] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and dotted(node.func) == LOAD_INLINE):
            continue
        args: dict[str, ast.expr] = {}
        for i, kind in ((1, "cpp_sources"), (2, "cuda_sources")):
            if len(node.args) > i:
                args[kind] = node.args[i]
        for kw in node.keywords:
            if kw.arg in ("cpp_sources", "cuda_sources"):
                args[kw.arg] = kw.value
        for kind in ("cpp_sources", "cuda_sources"):
            if kind not in args:
                continue
            parts = pieces(args[kind])
            if not parts:
                continue
            text_parts: list[str] = []
            line_map = [parts[0][1]]
            for text, line, one_to_one in parts:
                for i in range(1, text.count("\n") + 1):
                    line_map.append(line + i if one_to_one else line)
                text_parts.append(text)
            found.append(InlineSource(kind, "".join(text_parts), tuple(line_map)))
    return found
