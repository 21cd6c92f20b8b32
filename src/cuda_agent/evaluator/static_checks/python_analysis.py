"""The facts the ``model_new.py`` rules stand on, gathered from its AST before any rule runs.

Which local names are modules and members (through import aliases), which classes hold
torch layers and tensors, which names and ``self`` attributes reach the compiled
extension, and, within a function, which expressions are tensors.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from cuda_agent.evaluator.static_checks.ast_helpers import (
    LITERAL_NODES,
    assigned_targets,
    import_aliases,
    is_self_attr,
    str_const,
)
from cuda_agent.evaluator.static_checks.vocabulary import (
    COMPUTE_METHODS,
    EXTENSION_MODULE,
    LOAD_INLINE,
    NN_NOT_LAYERS,
    NON_TENSOR_ANNOTATIONS,
    NON_TENSOR_CALLS,
    NON_TENSOR_METHODS,
    TENSOR_ATTRS,
    TENSOR_PRESERVING_METHODS,
    TORCH_FACTORIES,
)


@dataclass
class ClassInfo:
    """A class of the file: its methods and what its instances hold."""

    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    layer_attrs: dict[str, str] = field(default_factory=dict)  # attr -> torch.nn class
    tensor_attrs: set[str] = field(default_factory=set)
    torch_layer_base: bool = False
    autograd_function: bool = False


@dataclass
class Scope:
    """Where the checker stands: function, class and the names known to be tensors."""

    func: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    cls: ClassInfo | None = None
    tensors: set[str] = field(default_factory=set)
    non_tensors: set[str] = field(default_factory=set)
    layers: dict[str, str] = field(default_factory=dict)  # local name -> torch.nn class
    init: bool = False  # directly inside __init__: only clear-cut compute is flagged
    exempt: bool = False  # autograd backward: compute rules off


class FileAnalysis:
    """What is known about ``model_new.py`` before its rules are checked.

    Import aliases, the names the file binds, its classes (layers and tensors they hold,
    torch bases), the names that reach the extension, and, per scope, which expressions
    are tensors. Over-approximate where the checker must stay precise: an honest file must
    never be flagged for what cannot be seen.
    """

    def __init__(self, tree: ast.Module, single_file: bool) -> None:
        self.tree = tree
        self.single_file = single_file
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.aliases = import_aliases(tree)
        self.module_defs: dict[str, ast.AST] = {}
        self.bound_names: set[str] = set()
        self._collect_module_bindings()
        self.docstrings = self._collect_docstrings()
        self.classes: dict[str, ClassInfo] = {}
        self._collect_classes()
        self.ext_aliases: set[str] = set()
        self.ext_self_attrs: set[str] = set()
        self.ext_factories: set[str] = set()
        self.load_inline_calls: list[ast.Call] = []
        self._discover_extension()

    # -- names ---------------------------------------------------------------------------

    def dotted(self, node: ast.expr) -> str | None:
        """Fully qualified name of a module member expression, through import aliases."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        if self.is_literal_getattr(node):
            assert isinstance(node, ast.Call)
            base = self.dotted(node.args[0])
            attr = str_const(node.args[1])
            return f"{base}.{attr}" if base else None
        return None

    def is_literal_getattr(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and "getattr" not in self.bound_names
            and len(node.args) >= 2
            and str_const(node.args[1]) is not None
        )

    # -- pre-passes ----------------------------------------------------------------------

    def _collect_module_bindings(self) -> None:
        for stmt in self.tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.module_defs[stmt.name] = stmt
                self.bound_names.add(stmt.name)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bound_names.add(node.id)
            elif isinstance(node, ast.arg):  # e.g. forward(self, input) shadows input()
                self.bound_names.add(node.arg)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bound_names.add(node.name)

    def _collect_docstrings(self) -> set[int]:
        ids: set[int] = set()
        for node in ast.walk(self.tree):
            body = getattr(node, "body", None)
            if isinstance(body, list):
                for stmt in body:
                    if isinstance(stmt, ast.Expr) and str_const(stmt.value) is not None:
                        ids.add(id(stmt.value))
        return ids

    def _collect_classes(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                info = ClassInfo(node)
                for stmt in node.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        info.methods[stmt.name] = stmt
                for base in node.bases:
                    dotted = self.dotted(base) or ""
                    if dotted == "torch.autograd.Function":
                        info.autograd_function = True
                    parts = dotted.split(".")
                    if (
                        len(parts) == 3
                        and parts[:2] == ["torch", "nn"]
                        and parts[2][:1].isupper()
                        and parts[2] not in NN_NOT_LAYERS
                    ):
                        info.torch_layer_base = True
                self._collect_class_attrs(info)
                self.classes.setdefault(node.name, info)
        # Inherit what local base classes define (one pass per level is enough in practice).
        for _ in range(3):
            for info in self.classes.values():
                for base in info.node.bases:
                    if isinstance(base, ast.Name) and base.id in self.classes:
                        parent = self.classes[base.id]
                        if parent is info:
                            continue
                        for name, fn in parent.methods.items():
                            info.methods.setdefault(name, fn)
                        for attr, cls in parent.layer_attrs.items():
                            info.layer_attrs.setdefault(attr, cls)
                        info.tensor_attrs |= parent.tensor_attrs
                        info.torch_layer_base |= parent.torch_layer_base
                        info.autograd_function |= parent.autograd_function

    def nn_layer_class(self, node: ast.expr | None) -> str | None:
        """'Conv2d' when ``node`` constructs a torch.nn layer whose call computes in torch."""
        if not isinstance(node, ast.Call):
            return None
        dotted = self.dotted(node.func) or ""
        parts = dotted.split(".")
        if len(parts) != 3 or parts[:2] != ["torch", "nn"] or not parts[2][:1].isupper():
            return None
        name = parts[2]
        if name in NN_NOT_LAYERS:
            return None
        if name == "Sequential":
            return name if any(self.nn_layer_class(a) for a in node.args) else None
        return name

    def _collect_class_attrs(self, info: ClassInfo) -> None:
        for node in ast.walk(info.node):
            for target, value in assigned_targets(node):
                if not is_self_attr(target):
                    continue
                assert isinstance(target, ast.Attribute)
                layer = self.nn_layer_class(value)
                if layer:
                    info.layer_attrs[target.attr] = layer
                elif isinstance(value, ast.Call):
                    dotted = self.dotted(value.func) or ""
                    if dotted in ("torch.nn.Parameter", "torch.nn.Buffer") or (
                        dotted.startswith("torch.") and dotted[6:] in TORCH_FACTORIES
                    ):
                        info.tensor_attrs.add(target.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("register_buffer", "register_parameter")
                and node.args
                and str_const(node.args[0])
            ):
                info.tensor_attrs.add(str_const(node.args[0]) or "")

    def is_load_inline(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and self.dotted(node.func) == LOAD_INLINE

    def is_ext_alias_expr(self, node: ast.expr | None) -> bool:
        """True for expressions that evaluate to the extension module or one of its members."""
        if node is None:
            return False
        if self.single_file and self.is_load_inline(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.ext_aliases
        if isinstance(node, ast.Attribute):
            if is_self_attr(node, self.ext_self_attrs):
                return True
            return self.is_ext_alias_expr(node.value)
        if isinstance(node, ast.Call):
            if self.is_literal_getattr(node):
                return self.is_ext_alias_expr(node.args[0])
            return isinstance(node.func, ast.Name) and node.func.id in self.ext_factories
        return False

    def _discover_extension(self) -> None:
        if not self.single_file:
            for name, target in self.aliases.items():
                if target == EXTENSION_MODULE or target.startswith(EXTENSION_MODULE + "."):
                    self.ext_aliases.add(name)
        self.load_inline_calls = [n for n in ast.walk(self.tree) if self.is_load_inline(n)]
        for _ in range(6):
            before = (len(self.ext_aliases), len(self.ext_self_attrs), len(self.ext_factories))
            for node in ast.walk(self.tree):
                for target, value in assigned_targets(node):
                    if not self.is_ext_alias_expr(value):
                        continue
                    if isinstance(target, ast.Name):
                        self.ext_aliases.add(target.id)
                    elif is_self_attr(target):
                        assert isinstance(target, ast.Attribute)
                        self.ext_self_attrs.add(target.attr)
            for name, fn in self.module_defs.items():
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for sub in ast.walk(fn):
                    if (self.single_file and self.is_load_inline(sub)) or (
                        isinstance(sub, ast.Return) and self.is_ext_alias_expr(sub.value)
                    ):
                        self.ext_factories.add(name)
                        break
            after = (len(self.ext_aliases), len(self.ext_self_attrs), len(self.ext_factories))
            if after == before:
                break

    def _is_ext_call(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Call) and self.is_ext_alias_expr(node.func)

    # -- tensor inference ----------------------------------------------------------------

    def is_tensor(self, node: ast.expr, scope: Scope) -> bool:
        if isinstance(node, ast.Name):
            return node.id in scope.tensors
        if isinstance(node, ast.Attribute):
            if scope.cls and is_self_attr(node, scope.cls.tensor_attrs):
                return True
            if node.attr in ("weight", "bias") and self.layer_of(node.value, scope):
                return True
            return node.attr in TENSOR_ATTRS and self.is_tensor(node.value, scope)
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value, scope) or self._is_ext_call(node.value)
        if isinstance(node, ast.Call):
            if self._is_ext_call(node):
                return True
            dotted = self.dotted(node.func) or ""
            if dotted.startswith("torch.") and dotted[6:] in TORCH_FACTORIES:
                return True
            if isinstance(node.func, ast.Attribute) and (
                node.func.attr in TENSOR_PRESERVING_METHODS or node.func.attr in COMPUTE_METHODS
            ):
                return self.is_tensor(node.func.value, scope)
            return False
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left, scope) or self.is_tensor(node.right, scope)
        if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
            return self.is_tensor(node.operand, scope)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body, scope) or self.is_tensor(node.orelse, scope)
        return False

    def layer_of(self, node: ast.expr, scope: Scope) -> str | None:
        if scope.cls and is_self_attr(node, scope.cls.layer_attrs):
            assert isinstance(node, ast.Attribute)
            return scope.cls.layer_attrs[node.attr]
        if isinstance(node, ast.Name):
            return scope.layers.get(node.id)
        return None

    def _is_non_tensor_value(self, value: ast.expr) -> bool:
        if isinstance(value, (*LITERAL_NODES, ast.GeneratorExp)):
            return True
        if isinstance(value, ast.Call):
            if isinstance(value.func, ast.Name) and value.func.id in NON_TENSOR_CALLS:
                return True
            if isinstance(value.func, ast.Attribute) and value.func.attr in NON_TENSOR_METHODS:
                return True
        return isinstance(value, ast.Attribute) and value.attr in ("shape", "dtype", "device")

    def _annotation_is_tensor(self, ann: ast.expr | None) -> bool | None:
        """True/False when an annotation says tensor / non-tensor, None when silent."""
        if ann is None:
            return None
        text = ast.unparse(ann)
        if "Tensor" in text:
            return True
        names = set(re.findall(r"[A-Za-z_]\w*", text)) - {"Optional", "typing", "Union"}
        if names and names <= NON_TENSOR_ANNOTATIONS | {"List", "Tuple", "Dict", "Sequence"}:
            return False
        return None

    def function_scope(
        self,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        cls: ClassInfo | None,
        outer: Scope,
    ) -> Scope:
        scope = Scope(func=fn, cls=cls)
        scope.tensors = set(outer.tensors)
        scope.layers = dict(outer.layers)
        scope.init = cls is not None and fn.name == "__init__"
        scope.exempt = outer.exempt or (
            cls is not None and cls.autograd_function and fn.name in ("backward", "setup_context")
        )
        args = fn.args
        positional = list(args.posonlyargs) + list(args.args)
        is_static = any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
        )
        if cls is not None and positional and (not is_static or cls.autograd_function):
            positional = positional[1:]  # self / cls / ctx
        n_defaults = len(args.defaults)
        all_positional = list(args.posonlyargs) + list(args.args)
        with_default = {a.arg for a in all_positional[len(all_positional) - n_defaults :]}
        with_default |= {
            a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
        }
        is_forward = cls is not None and fn.name in ("forward", "backward")
        for a in positional + list(args.kwonlyargs):
            hint = self._annotation_is_tensor(a.annotation)
            if hint is True or (hint is None and is_forward and a.arg not in with_default):
                scope.tensors.add(a.arg)
        for _ in range(8):
            size = (len(scope.tensors), len(scope.non_tensors), len(scope.layers))
            for node in ast.walk(fn):
                for target, value in assigned_targets(node):
                    if not isinstance(target, ast.Name) or value is None:
                        continue
                    if isinstance(node, ast.AugAssign) and target.id in scope.tensors:
                        continue
                    if self.is_tensor(value, scope):
                        scope.tensors.add(target.id)
                    elif self._is_non_tensor_value(value):
                        scope.non_tensors.add(target.id)
                    layer = self.nn_layer_class(value) or self.layer_of(value, scope)
                    if layer:
                        scope.layers[target.id] = layer
                if isinstance(node, (ast.For, ast.comprehension)) and self.is_tensor(
                    node.iter, scope
                ):
                    for t in ast.walk(node.target):
                        if isinstance(t, ast.Name):
                            scope.tensors.add(t.id)
            if (len(scope.tensors), len(scope.non_tensors), len(scope.layers)) == size:
                break
        return scope

    # -- extension reachability ----------------------------------------------------------

    def reaches_extension(self, start: ast.AST, cls_name: str) -> bool:
        """Whether an extension reference is reachable from ``start`` (over-approximate)."""
        reaching_defs: set[str] = set()
        reaching_attrs: set[str] = set(self.ext_self_attrs)
        reaching_methods: dict[str, set[str]] = {}

        def refs(node: ast.AST, owner: str | None) -> bool:
            for sub in ast.walk(node):
                if self.single_file and self.is_load_inline(sub):
                    return True
                if isinstance(sub, ast.Name) and (
                    sub.id in self.ext_aliases or sub.id in reaching_defs
                ):
                    return True
                if isinstance(sub, ast.Attribute) and is_self_attr(sub):
                    if sub.attr in reaching_attrs:
                        return True
                    if owner and sub.attr in reaching_methods.get(owner, set()):
                        return True
            return False

        def owner_of(node: ast.AST) -> str | None:
            parent = self.parents.get(node)
            while parent is not None and not isinstance(parent, ast.ClassDef):
                parent = self.parents.get(parent)
            return parent.name if isinstance(parent, ast.ClassDef) else None

        for _ in range(8):
            before = (
                len(reaching_defs),
                len(reaching_attrs),
                sum(len(v) for v in reaching_methods.values()),
            )
            for name, info in self.classes.items():
                for mname, fn in info.methods.items():
                    if refs(fn, name):
                        reaching_methods.setdefault(name, set()).add(mname)
                if reaching_methods.get(name) and name in self.module_defs:
                    reaching_defs.add(name)
            for name, node in self.module_defs.items():
                if not isinstance(node, ast.ClassDef) and refs(node, None):
                    reaching_defs.add(name)
            for node in ast.walk(self.tree):
                for target, value in assigned_targets(node):
                    if value is not None and is_self_attr(target) and refs(value, owner_of(node)):
                        assert isinstance(target, ast.Attribute)
                        reaching_attrs.add(target.attr)
            after = (
                len(reaching_defs),
                len(reaching_attrs),
                sum(len(v) for v in reaching_methods.values()),
            )
            if after == before:
                break
        return refs(start, cls_name)
