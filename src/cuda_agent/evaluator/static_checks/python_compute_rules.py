"""The ``torch-compute-op`` rules that depend on which values are tensors.

Operators (``@``, arithmetic, comparisons, unary, augmented assignment) on tensors, torch.nn
layers being run, builtins such as ``abs``/``sum`` on tensors, and tensor compute methods
(``x.sum()``, ``x.relu_()``). Checked inside functions only, never in ``__init__`` (its
weights are replaced by ``load_state_dict``) nor in an autograd ``backward``. This visitor
also holds what every rule needs (the file's facts, the current scope, the report);
:mod:`python_rules` adds the rules on names, imports and structure.
"""

from __future__ import annotations

import ast

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.static_checks.ast_helpers import LITERAL_NODES
from cuda_agent.evaluator.static_checks.python_analysis import FileAnalysis, Scope
from cuda_agent.evaluator.static_checks.violation import Violation
from cuda_agent.evaluator.static_checks.vocabulary import (
    COMPUTE_METHODS,
    NON_TENSOR_CALLS,
    TENSOR_BUILTINS,
)


class ComputeRules(ast.NodeVisitor):
    """Visits ``model_new.py`` reporting PyTorch compute done through tensors."""

    def __init__(self, source: str, tree: ast.Module, filename: str, single_file: bool) -> None:
        self.source = source
        self.filename = filename
        self.single_file = single_file
        self.facts = FileAnalysis(tree, single_file)
        self.violations: list[Violation] = []
        self.scope = Scope()

    # -- helpers -------------------------------------------------------------------------

    def add(self, rule: str, node: ast.AST | int, message: str) -> None:
        line = node if isinstance(node, int) else getattr(node, "lineno", 0)
        self.violations.append(Violation(rule, self.filename, line, message))

    def src(self, node: ast.AST, limit: int = 60) -> str:
        text = ast.get_source_segment(self.source, node) or ast.unparse(node)
        text = " ".join(text.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    # -- operators -----------------------------------------------------------------------

    def _operators_checked(self) -> bool:
        return self.scope.func is not None and not self.scope.init and not self.scope.exempt

    def visit_BinOp(self, node: ast.BinOp) -> None:
        parent = self.facts.parents.get(node)
        nested = isinstance(parent, ast.BinOp)
        if isinstance(node.op, ast.MatMult):
            if not (self.scope.exempt or self.scope.init) and not (
                nested and isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult)
            ):
                self.add(
                    rules.TORCH_COMPUTE,
                    node,
                    f"`{self.src(node)}` is a PyTorch matrix multiply (@); write the GEMM in "
                    "your extension instead.",
                )
        elif self._operators_checked() and self.facts.is_tensor(node, self.scope):
            parent_flagged = (
                nested
                and isinstance(parent, ast.BinOp)
                and not isinstance(parent.op, ast.MatMult)
                and self.facts.is_tensor(parent, self.scope)
            )
            has_matmul = any(
                isinstance(side, ast.BinOp) and isinstance(side.op, ast.MatMult)
                for side in (node.left, node.right)
            )
            if not parent_flagged and not has_matmul and not self._inside_matmul(node):
                self.add(
                    rules.TORCH_COMPUTE,
                    node,
                    f"`{self.src(node)}` applies a PyTorch operator to tensors; compute it in "
                    "your extension kernel instead.",
                )
        self.generic_visit(node)

    def _inside_matmul(self, node: ast.AST) -> bool:
        parent = self.facts.parents.get(node)
        while isinstance(parent, ast.BinOp):
            if isinstance(parent.op, ast.MatMult):
                return True
            parent = self.facts.parents.get(parent)
        return False

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if (
            self._operators_checked()
            and not isinstance(node.op, ast.Not)
            and self.facts.is_tensor(node.operand, self.scope)
            and not isinstance(self.facts.parents.get(node), ast.BinOp)
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` applies a PyTorch operator to a tensor; compute it in "
                "your extension kernel instead.",
            )
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        identity = (ast.Is, ast.IsNot, ast.In, ast.NotIn)
        if (
            self._operators_checked()
            and not all(isinstance(op, identity) for op in node.ops)
            and any(self.facts.is_tensor(e, self.scope) for e in [node.left, *node.comparators])
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` compares tensors elementwise in PyTorch; compute it in "
                "your extension kernel instead.",
            )
        self.generic_visit(node)

    # Subclasses' visit_AugAssign and visit_Call call these two and then generic_visit, so
    # that nesting costs no more stack frames than one visitor method (deep files hit the
    # recursion limit at the same depth as before).

    def check_aug_assign(self, node: ast.AugAssign) -> None:
        if self._operators_checked() and (
            isinstance(node.op, ast.MatMult)
            or self.facts.is_tensor(node.target, self.scope)
            or self.facts.is_tensor(node.value, self.scope)
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` applies a PyTorch operator to a tensor; compute it in "
                "your extension kernel instead.",
            )

    # -- calls ---------------------------------------------------------------------------

    def check_call(self, node: ast.Call) -> None:
        if self._operators_checked():
            self._check_call_compute(node)
        elif (
            not self.scope.exempt
            and isinstance(node.func, ast.Call)
            and self.facts.nn_layer_class(node.func)
        ):
            self.add(rules.TORCH_COMPUTE, node, self._layer_message(node))

    def _layer_message(self, node: ast.Call) -> str:
        return (
            f"`{self.src(node)}` runs a torch.nn module, which computes in PyTorch; keep modules "
            "only to hold weights and compute with your extension instead."
        )

    def _check_call_compute(self, node: ast.Call) -> None:
        func = node.func
        scope = self.scope
        where = scope.func.name if scope.func else "module"
        # torch.nn layers being run.
        if isinstance(func, ast.Call) and self.facts.nn_layer_class(func):
            self.add(rules.TORCH_COMPUTE, node, self._layer_message(node))
            return
        layer = self.facts.layer_of(func, scope)
        target = func
        if (
            layer is None
            and isinstance(func, ast.Attribute)
            and func.attr in ("forward", "__call__")
        ):
            layer = self.facts.layer_of(func.value, scope)
            target = func.value
        if layer:
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` calls the torch.nn.{layer} module {self.src(target)} in "
                f"{where}; keep it for its weights ({self.src(target)}.weight) and compute with "
                "your extension instead.",
            )
            return
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "super"
            and scope.cls is not None
            and scope.cls.torch_layer_base
            and (func.attr in ("forward", "__call__") or func.attr.startswith("_"))
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` runs the inherited torch.nn layer, which computes in "
                "PyTorch; compute with your extension instead.",
            )
            return
        # Builtins applied to tensors.
        if (
            isinstance(func, ast.Name)
            and func.id in TENSOR_BUILTINS
            and func.id not in self.facts.bound_names
            and any(self.facts.is_tensor(a, self.scope) for a in node.args)
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` reduces or transforms a tensor with a PyTorch operator; "
                "compute it in your extension kernel instead.",
            )
            return
        # Tensor compute methods.
        if (
            isinstance(func, ast.Attribute)
            and func.attr in COMPUTE_METHODS
            and not self._skip_method_receiver(func.value)
        ):
            self.add(
                rules.TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` calls the tensor method .{func.attr}(), which computes in "
                "PyTorch; do it in your extension kernel instead.",
            )

    def _skip_method_receiver(self, recv: ast.expr) -> bool:
        scope = self.scope
        if isinstance(recv, LITERAL_NODES):
            return True
        if (
            isinstance(recv, ast.Call)
            and isinstance(recv.func, ast.Name)
            and (recv.func.id == "super" or recv.func.id in NON_TENSOR_CALLS)
        ):
            return True
        if self.facts.dotted(recv) is not None or self.facts.is_ext_alias_expr(recv):
            return True  # module members are judged by their qualified name
        if isinstance(recv, ast.Name):
            name = recv.id
            if name in ("self", "cls"):
                return True
            if name in self.facts.module_defs or name in self.facts.classes:
                return True
            if name in scope.non_tensors and name not in scope.tensors:
                return True
        return False
