"""Verdicts on fully qualified Python names: ``torch.*`` and ``os.*`` references and imports.

Each function answers (rule, message) for a name a solution may not use, or None when it
is allowed; the AST checker resolves aliases first and decides where to report.
"""

from __future__ import annotations

from collections.abc import Iterable

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.static_checks.vocabulary import (
    ALLOWED_MODULES,
    COMPUTE_METHODS,
    EXTENSION_MODULE,
    LOAD_INLINE,
    NN_ALLOWED_SUBMODULES,
    OS_ALLOWED,
    OS_THREADS,
    THREAD_MODULES,
    TORCH_ALLOWED_TOP,
    TORCH_AUTOGRAD_ALLOWED,
    TORCH_CUDA_FORBIDDEN,
    TORCH_TAMPER,
    is_dunder,
)

Verdict = tuple[str, str]  # (rule, message)


def _under(dotted: str, prefixes: Iterable[str]) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in prefixes)


def _compute_message(shown: str) -> str:
    return f"`{shown}` computes in PyTorch; do this computation in your extension kernel instead."


def classify_torch(dotted: str, *, single_file: bool) -> Verdict | None:
    """Rule and message for a resolved ``torch...`` name, or None when it is allowed."""
    parts = dotted.split(".")
    if len(parts) < 2:
        return None
    for part in parts[1:]:
        if part.startswith("_") and not is_dunder(part):
            return (
                rules.INTROSPECTION,
                f"`{dotted}` reaches into private torch internals; use only public tensor "
                "creation and metadata APIs plus your extension.",
            )
    p1 = parts[1]
    if is_dunder(p1):
        return None  # reported by the dunder-attribute check unless allowed
    if p1 == "utils":
        if single_file and dotted in (
            "torch.utils.cpp_extension",
            LOAD_INLINE,
        ):
            return None
        if single_file:
            msg = (
                f"`{dotted}` is off limits; a single-file solution may use only "
                "`torch.utils.cpp_extension.load_inline` from torch.utils."
            )
        else:
            msg = (
                f"`{dotted}` is off limits in the workspace format; kernels are built by "
                "`bash utils/compile.sh` into `cuda_extension`, so import that instead."
            )
        return (rules.INTROSPECTION, msg)
    if p1 in TORCH_TAMPER:
        return (
            rules.INTROSPECTION,
            f"`{dotted}` reaches PyTorch's operator/dispatch machinery; call the functions of "
            "your extension module directly instead.",
        )
    if p1 in ("multiprocessing", "distributed"):
        return (
            rules.THREADS,
            f"`{dotted}` starts extra processes or workers; run all work in the calling "
            "thread through your extension.",
        )
    if p1 in ("compile", "jit"):
        return (
            rules.TORCH_COMPUTE,
            f"`{dotted}` hands the computation to PyTorch's compiler; write the kernel "
            "yourself in the extension instead.",
        )
    if p1 == "nn":
        if len(parts) == 2:
            return None
        p2 = parts[2]
        if p2 == "functional":
            what = "is" if len(parts) == 3 else "belongs to torch.nn.functional, which is"
            return (
                rules.FUNCTIONAL,
                f"`{dotted}` {what} blocked while ModelNew runs; implement the operation in "
                "your kernel instead.",
            )
        if p2 in NN_ALLOWED_SUBMODULES:
            return None
        if p2[:1].isupper():
            if len(parts) > 3 and parts[3] == "forward":
                return (rules.TORCH_COMPUTE, _compute_message(dotted))
            return None
        return (rules.TORCH_COMPUTE, _compute_message(dotted))
    if p1 == "cuda":
        if len(parts) > 2 and parts[2] in TORCH_CUDA_FORBIDDEN:
            return (rules.TORCH_COMPUTE, _compute_message(dotted))
        return None
    if p1 == "autograd":
        if len(parts) == 2 or parts[2] in TORCH_AUTOGRAD_ALLOWED:
            return None
        return (rules.TORCH_COMPUTE, _compute_message(dotted))
    if p1 == "Tensor":
        if len(parts) > 2 and parts[2] in COMPUTE_METHODS:
            return (rules.TORCH_COMPUTE, _compute_message(dotted))
        return None
    if p1 in TORCH_ALLOWED_TOP:
        return None
    return (rules.TORCH_COMPUTE, _compute_message(dotted))



def classify_os(dotted: str) -> Verdict | None:
    """``os`` in a single-file solution: build variables and paths only."""
    if _under(dotted, OS_ALLOWED):
        return None
    if dotted.startswith(OS_THREADS):
        return (
            rules.THREADS,
            f"`{dotted}` starts another process; run everything in the calling process.",
        )
    return (
        rules.FORBIDDEN_IMPORT,
        f"`{dotted}` is not allowed; a single-file solution may use os only for "
        "os.environ, os.getenv and os.path.",
    )


def classify_import(path: str, *, single_file: bool, filename: str) -> Verdict | None:
    """An absolute import of ``path`` (a module, or ``module.member`` for ``from`` imports)."""
    root = path.split(".")[0]
    if root == "model":
        return (
            rules.REFERENCE_FALLBACK,
            f"importing `{path}` uses the reference implementation; ModelNew must compute "
            "everything through your own kernels.",
        )
    if root == "torch":
        return classify_torch(path, single_file=single_file)
    if root == EXTENSION_MODULE:
        if single_file:
            return (
                rules.FORBIDDEN_IMPORT,
                f"`import {EXTENSION_MODULE}` belongs to the workspace format; a "
                "single-file solution builds its own module with `load_inline`.",
            )
        return None
    if root in ALLOWED_MODULES:
        return None
    if root in THREAD_MODULES:
        return (
            rules.THREADS,
            f"`{path}` runs work on other threads or processes; launch your kernels from "
            "the calling thread instead.",
        )
    if root == "os" and single_file:
        return None if path == "os" else classify_os(path)
    allowed = "torch, torch.nn, math, typing, functools, dataclasses, collections"
    allowed += ", torch.utils.cpp_extension.load_inline, os" if single_file else ""
    allowed += "" if single_file else f", {EXTENSION_MODULE}"
    return (
        rules.FORBIDDEN_IMPORT,
        f"importing `{path}` is not allowed in {filename}; use only {allowed}.",
    )
