"""The rules for ``model_new.py``, checked on its AST (nothing is imported or executed).

One visitor walks the file and reports, with the line: forbidden and relative imports,
reference fallbacks, ``try``/``except``, torch names that compute or reach internals,
``torch.nn.functional``, introspection and monkey-patching, threads and processes, and
``load_inline`` flags that bring in other libraries; last, whether ``ModelNew.forward``
reaches the extension. It extends :class:`ComputeRules` (compute through tensor operators,
methods and layers); the facts both judge by come from :class:`FileAnalysis`, verdicts on
qualified names from :mod:`python_names`.
"""

from __future__ import annotations

import ast
import re

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.static_checks.ast_helpers import (
    assigned_targets,
    root_name,
    str_const,
)
from cuda_agent.evaluator.static_checks.python_analysis import Scope
from cuda_agent.evaluator.static_checks.python_compute_rules import ComputeRules
from cuda_agent.evaluator.static_checks.python_names import (
    Verdict,
    classify_import,
    classify_os,
    classify_torch,
)
from cuda_agent.evaluator.static_checks.violation import Violation, dedupe
from cuda_agent.evaluator.static_checks.vocabulary import (
    ALLOWED_ATTR_DUNDERS,
    ALLOWED_DEF_DUNDERS,
    ALLOWED_LINK_LIBS,
    ALLOWED_MODULES,
    ALLOWED_NAME_DUNDERS,
    DANGEROUS_BUILTINS,
    EXTENSION_MODULE,
    MODEL_NEW,
    REFERENCE_NAMES,
    is_dunder,
)


class _PythonChecker(ComputeRules):
    """Adds to the compute rules those on imports, names, attributes and structure."""

    def __init__(self, source: str, tree: ast.Module, filename: str, single_file: bool) -> None:
        super().__init__(source, tree, filename, single_file)
        self.in_main_guard = False

    # -- imports -------------------------------------------------------------------------

    def report(self, verdict: Verdict | None, node: ast.AST) -> None:
        if verdict:
            self.add(verdict[0], node, verdict[1])

    def _check_module_path(self, path: str, node: ast.AST) -> None:
        verdict = classify_import(path, single_file=self.single_file, filename=self.filename)
        self.report(verdict, node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._check_module_path(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            names = [node.module or ""] + [a.name for a in node.names]
            if any("model" in n.split(".")[0] for n in names if n):
                self.add(
                    rules.REFERENCE_FALLBACK,
                    node,
                    "a relative import of the task's model uses the reference implementation; "
                    "ModelNew must compute everything through your own kernels.",
                )
            else:
                self.add(
                    rules.FORBIDDEN_IMPORT,
                    node,
                    f"relative imports are not allowed; a solution's only Python file is "
                    f"{MODEL_NEW}.",
                )
            return
        module = node.module or ""
        for a in node.names:
            if a.name == "*":
                root = module.split(".")[0]
                if root in ALLOWED_MODULES:
                    continue
                self.add(
                    rules.FORBIDDEN_IMPORT,
                    node,
                    f"`from {module} import *` hides which names are used; import the names "
                    "you need explicitly.",
                )
                continue
            self._check_module_path(f"{module}.{a.name}", node)

    # -- structure -----------------------------------------------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        info = self.facts.classes.get(node.name)
        saved = self.scope
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._check_def_name(stmt, node.name)
        for expr in [*node.bases, *node.decorator_list]:
            self.visit(expr)
        for kw in node.keywords:
            self.visit(kw)
        self.scope = Scope(cls=info, tensors=set(saved.tensors), exempt=saved.exempt)
        for stmt in node.body:
            self.visit(stmt)
        self.scope = saved

    def _check_def_name(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: str) -> None:
        if is_dunder(fn.name) and fn.name not in ALLOWED_DEF_DUNDERS:
            self.add(
                rules.INTROSPECTION,
                fn,
                f"defining `{owner}.{fn.name}` overrides Python/PyTorch machinery; put the "
                "computation in forward and call your extension there.",
            )

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.scope.cls is None and self.scope.func is None:
            self._check_def_name(node, "module")
        for expr in node.decorator_list:
            self.visit(expr)
        if node.returns:
            self.visit(node.returns)
        self.visit(node.args)
        saved = self.scope
        cls = saved.cls if saved.func is None else None
        self.scope = self.facts.function_scope(node, cls, saved)
        if saved.func is not None:  # nested function: keep the enclosing class context
            self.scope.cls = saved.cls
            self.scope.init = saved.init
        for stmt in node.body:
            self.visit(stmt)
        self.scope = saved

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        is_main = (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and len(test.comparators) == 1
            and str_const(test.comparators[0]) == "__main__"
        )
        if not is_main:
            self.generic_visit(node)
            return
        saved = self.in_main_guard
        self.in_main_guard = True
        self.generic_visit(node)
        self.in_main_guard = saved

    def _visit_try(self, node: ast.AST) -> None:
        if getattr(node, "handlers", None):
            self.add(
                rules.TRY_EXCEPT,
                node,
                f"try/except is not allowed in {self.filename} because it can hide a "
                "fallback around the extension; remove it and let errors surface.",
            )
        self.generic_visit(node)

    visit_Try = _visit_try
    if hasattr(ast, "TryStar"):
        visit_TryStar = _visit_try

    # -- names and attributes ------------------------------------------------------------

    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Load):
            return
        name = node.id
        if name in REFERENCE_NAMES and not self.in_main_guard:
            self.add(
                rules.REFERENCE_FALLBACK,
                node,
                f"`{name}` belongs to the reference task; ModelNew must not use it and must "
                "compute through your own kernels.",
            )
        elif name in DANGEROUS_BUILTINS and name not in self.facts.bound_names:
            parent = self.facts.parents.get(node)
            if name == "getattr" and isinstance(parent, ast.Call) and parent.func is node:
                if self.facts.is_literal_getattr(parent):
                    return
                self.add(
                    rules.INTROSPECTION,
                    node,
                    "`getattr` with a computed attribute name hides what is accessed; use "
                    "plain attribute access or a string literal.",
                )
                return
            self.add(
                rules.INTROSPECTION,
                node,
                f"the builtin `{name}` is not allowed in {self.filename} (dynamic code, "
                "file access or attribute tampering); write plain code that calls your "
                "extension.",
            )
        elif is_dunder(name) and name not in ALLOWED_NAME_DUNDERS:
            self.add(
                rules.INTROSPECTION,
                node,
                f"`{name}` reaches interpreter internals; remove it and write plain code.",
            )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        parent = self.facts.parents.get(node)
        maximal = not (isinstance(parent, ast.Attribute) and parent.value is node)
        dotted = self.facts.dotted(node) if maximal else None
        if is_dunder(attr):
            if attr not in ALLOWED_ATTR_DUNDERS:
                self.add(
                    rules.INTROSPECTION,
                    node,
                    f"`{self.src(node)}` accesses the dunder attribute {attr}; use ordinary "
                    "attributes and your extension's functions instead.",
                )
        elif attr.startswith("_") and not (self.facts.dotted(node) or "").startswith("torch."):
            receiver = node.value
            own = isinstance(receiver, ast.Name) and (
                receiver.id in ("self", "cls") or receiver.id in self.facts.classes
            )
            if not own:
                self.add(
                    rules.INTROSPECTION,
                    node,
                    f"`{self.src(node)}` accesses a private attribute of an object this file "
                    "does not own; use public APIs only.",
                )
        if dotted and isinstance(node.ctx, ast.Load):
            self._check_dotted(dotted, node)
        self.generic_visit(node)

    def _check_dotted(self, dotted: str, node: ast.AST) -> None:
        root = dotted.split(".")[0]
        if root == "torch":
            verdict = classify_torch(dotted, single_file=self.single_file)
            if not verdict:
                return
            rule, message = verdict
            if rule in (rules.TORCH_COMPUTE, rules.FUNCTIONAL) and self.scope.exempt:
                return
            if rule == rules.TORCH_COMPUTE and self.scope.init:
                return  # weights and buffers built here are replaced by load_state_dict
            shown = self.src(node)
            if shown != dotted:
                message = message.replace(f"`{dotted}`", f"`{shown}` ({dotted})", 1)
            self.add(rule, node, message)
        elif root == "os" and self.single_file:
            self.report(classify_os(dotted), node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if (
            isinstance(node.value, str)
            and id(node) not in self.facts.docstrings
            and re.search(r"\bmodel\.py\b", node.value)
        ):
            self.add(
                rules.REFERENCE_FALLBACK,
                node,
                "a string names model.py, the reference implementation; ModelNew must not "
                "read or load it.",
            )

    # -- assignments (monkey-patching) ---------------------------------------------------

    def _check_store_target(self, target: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._check_store_target(elt.value if isinstance(elt, ast.Starred) else elt)
            return
        if isinstance(target, ast.Subscript):
            dotted = self.facts.dotted(target.value) or ""
            if dotted and not dotted.startswith("os.environ"):
                self.add(
                    rules.INTROSPECTION,
                    target,
                    f"assigning into `{self.src(target)}` modifies a module's state; keep "
                    "state on self and leave modules untouched.",
                )
            return
        if not isinstance(target, ast.Attribute):
            return
        root = root_name(target)
        if is_dunder(target.attr):
            return  # reported as a dunder attribute access
        patched = root is None or (
            root.id not in ("self", "cls", "ctx")
            and (
                root.id in self.facts.aliases
                or root.id in self.facts.module_defs
                or root.id in self.facts.ext_aliases
            )
        )
        if patched:
            self.add(
                rules.INTROSPECTION,
                target,
                f"assigning `{self.src(target)}` monkey-patches an object this file does not "
                "own; keep state on self and call your extension directly.",
            )

    def _visit_targets(self, node: ast.Assign | ast.Delete) -> None:
        for t in node.targets:
            self._check_store_target(t)
        self.generic_visit(node)

    visit_Assign = _visit_targets
    visit_Delete = _visit_targets

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_store_target(node.target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store_target(node.target)
        self.check_aug_assign(node)
        self.generic_visit(node)

    # -- calls ---------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        if self.facts.is_literal_getattr(node):
            dotted = self.facts.dotted(node)
            attr = str_const(node.args[1]) or ""
            if dotted:
                self._check_dotted(dotted, node)
            elif is_dunder(attr) and attr not in ALLOWED_ATTR_DUNDERS:
                self.add(
                    rules.INTROSPECTION,
                    node,
                    f"`{self.src(node)}` accesses the dunder attribute {attr}; use ordinary "
                    "attributes instead.",
                )
        if self.facts.is_load_inline(node):
            self._check_load_inline_flags(node)
        self.check_call(node)
        self.generic_visit(node)

    def _check_load_inline_flags(self, node: ast.Call) -> None:
        headers = "only the CUDA toolkit, cuBLAS, cuDNN and torch headers may be used"
        for kw in node.keywords:
            if not isinstance(kw.value, (ast.List, ast.Tuple)):
                continue
            for elt in kw.value.elts:
                flag = str_const(elt)
                if flag is None:
                    continue  # computed flags are left to the build
                if kw.arg == "extra_include_paths" and "cuda" not in flag.lower():
                    self.add(
                        rules.LIBRARY,
                        elt,
                        f"the include path `{flag}` brings in third-party headers; {headers}.",
                    )
                if kw.arg == "extra_ldflags":
                    for lib in re.findall(r"(?:^|\s)-l\s*([\w+.-]+)", flag):
                        if lib not in ALLOWED_LINK_LIBS:
                            self.add(
                                rules.LIBRARY,
                                elt,
                                f"linking `-l{lib}` brings in a third-party library; only "
                                "cuBLAS and cuDNN may be linked.",
                            )
                if kw.arg in ("extra_cflags", "extra_cuda_cflags"):
                    for path in re.findall(r"(?:^|\s)-(?:I|isystem)\s*(\S+)", flag):
                        if "cuda" not in path.lower():
                            self.add(
                                rules.LIBRARY,
                                elt,
                                f"the include flag `{flag}` brings in third-party headers; "
                                f"{headers}.",
                            )

    # -- extension reachability ----------------------------------------------------------

    def check_extension_use(self) -> None:
        model_new = next(
            (
                s
                for s in reversed(self.facts.tree.body)
                if isinstance(s, ast.ClassDef) and s.name == "ModelNew"
            ),
            None,
        )
        if model_new is None:
            aliased = any(
                isinstance(t, ast.Name) and t.id == "ModelNew"
                for s in self.facts.tree.body
                for t, _ in assigned_targets(s)
            )
            if not aliased:
                self.add(
                    rules.MISSING_MODELNEW,
                    0,
                    f"{self.filename} defines no `class ModelNew`; define it with the same "
                    "constructor arguments as Model.",
                )
            return
        if not self.facts.ext_aliases and not self.facts.load_inline_calls:
            if self.single_file:
                msg = (
                    "model_new.py never builds an extension with `load_inline`; compile your "
                    "kernels with load_inline and call the returned module in ModelNew.forward."
                )
            else:
                msg = (
                    f"model_new.py never imports `{EXTENSION_MODULE}`; import it and call your "
                    "kernels from ModelNew.forward."
                )
            self.add(rules.NO_EXTENSION, model_new, msg)
            return
        info = self.facts.classes.get("ModelNew")
        forward = info.methods.get("forward") if info else None
        if forward is None:
            self.add(
                rules.NO_EXTENSION,
                model_new,
                "ModelNew defines no `forward`; define forward and call your extension in it.",
            )
            return
        if not self.facts.reaches_extension(forward, "ModelNew"):
            name = "the module returned by load_inline" if self.single_file else EXTENSION_MODULE
            self.add(
                rules.NO_EXTENSION,
                forward,
                f"ModelNew.forward never calls {name}; route the computation through your "
                "compiled kernels.",
            )


def check_model_new(
    source: str, *, filename: str = MODEL_NEW, single_file: bool = False
) -> list[Violation]:
    """Check ``model_new.py`` (workspace format, or KernelBench single file)."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        if not isinstance(exc, SyntaxError):
            return [
                Violation(
                    rules.SYNTAX,
                    filename,
                    0,
                    f"{filename} could not be parsed ({type(exc).__name__}); simplify it.",
                )
            ]
        return [
            Violation(
                rules.SYNTAX,
                filename,
                exc.lineno or 0,
                f"{filename} does not parse ({exc.msg}); fix the syntax so it can be imported.",
            )
        ]
    try:
        checker = _PythonChecker(source, tree, filename, single_file)
        checker.visit(tree)
        checker.check_extension_use()
    except RecursionError:
        # A hostile or generated file can nest expressions deeper than the stack allows.
        return [
            Violation(
                rules.SYNTAX,
                filename,
                0,
                f"{filename} nests expressions too deeply to be checked; split long "
                "expressions into separate statements.",
            )
        ]
    return dedupe(checker.violations)

