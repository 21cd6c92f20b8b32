"""Static checks on a candidate solution, run before anything is built or imported.

The runtime checks (torch.nn.functional blocked while ``ModelNew`` runs, outputs compared
with fresh inputs, the sandbox) are the authority; these checks exist to reject obvious
rule breaks early and to say precisely, with file and line, what to change. They are tuned
for precision: an honest solution must pass, so anything that cannot be decided from the
text is left to the runtime.

Python (``model_new.py``, parsed with :mod:`ast`; nothing is imported or executed):

``forbidden-import``
    Caught: imports outside ``torch``, ``torch.nn``, ``torch.cuda``, ``torch.autograd``,
    ``cuda_extension`` (workspace format only), ``math``, ``typing``,
    ``typing_extensions``, ``functools``, ``dataclasses``, ``collections``, ``enum``,
    ``abc``, ``numbers``, ``itertools`` and ``__future__``. In the single-file format
    ``torch.utils.cpp_extension.load_inline`` and ``os`` are allowed too, ``os`` only for
    ``os.environ``, ``os.getenv`` and ``os.path`` (KernelBench generations set build
    variables such as ``TORCH_CUDA_ARCH_LIST``). Also: any Python file in the solution
    other than ``model_new.py``. Not caught: imports done through strings at run time
    (``__import__`` and friends are flagged as introspection instead).
``reference-fallback``
    Caught: importing ``model`` (absolute or relative), any use of the names ``Model``,
    ``get_inputs`` or ``get_init_inputs`` (outside an ``if __name__ == "__main__":``
    block), and a string literal naming ``model.py`` (docstrings excepted) in Python or
    C++. Not caught: a reference implementation re-typed under another name (the
    torch-compute rule usually catches it).
``try-except-fallback``
    Caught: every ``try`` statement with an ``except`` clause. ``try``/``finally`` alone
    is allowed because it cannot swallow an error.
``torch-compute-op``
    Caught: ``torch.<op>`` references that are not tensor creation, metadata, dtype,
    device, grad-mode or view/concatenation helpers; ``torch.Tensor.<op>``;
    ``torch.compile`` and ``torch.jit``; calls of well-known tensor compute methods
    (``x.sum()``, ``x.matmul(w)``, ``x.relu_()``, ...) on anything not known to be a
    non-tensor; the ``@`` operator; arithmetic, comparison and unary operators where an
    operand is clearly a tensor (a ``forward`` parameter, the result of an extension
    call or a tensor factory, ``self.<parameter or buffer>``, ``self.<layer>.weight``,
    and views of those); builtins such as ``abs``/``sum``/``max`` on such tensors; calling
    a ``torch.nn`` layer (``self.conv(x)``, ``nn.ReLU()(x)``, ``super().forward`` in a
    class derived from a torch layer). Not checked: ``__init__`` (parameters and buffers
    built there, such as a ``torch.tril`` mask copied from Model, are replaced by
    ``load_state_dict``), methods named ``backward`` of ``torch.autograd.Function``
    subclasses (evaluation runs forward only), and tensor methods and operators in
    module-level statements. Not caught: operators on values whose tensor-ness is not
    visible (helper-function results, loop variables over containers), elements of
    ``nn.ModuleList``/``nn.ModuleDict`` called as layers, data movement that needs no
    arithmetic (``cat``, ``stack``, ``repeat``, ``flip``, ``roll``).
``functional-call``
    Caught: importing ``torch.nn.functional`` under any name and every reference to
    one of its members.
``introspection``
    Caught: dunder attributes other than ``__init__``, ``__name__``, ``__qualname__``,
    ``__doc__`` and ``__version__``; dunder names other than ``__name__``, ``__file__``
    and ``__doc__``; private attributes (``_x``) of anything but ``self``/``cls`` or a
    class of this file; private torch modules and ``torch.ops``, ``torch.library``,
    ``torch.overrides``, ``torch.fx``, ``torch.utils`` (except ``load_inline`` in the
    single-file format) and similar; the builtins ``exec``, ``eval``, ``compile``,
    ``__import__``, ``globals``, ``locals``, ``vars``, ``setattr``, ``delattr``,
    ``open``, ``input``, ``breakpoint`` and ``getattr`` without a literal attribute name
    (unless the file defines a name of its own with that spelling); defining dunder
    methods other than ``__init__``, ``__repr__``, ``__str__`` and ``__post_init__``;
    assigning or deleting attributes of modules, imported names, classes and functions of
    the file (monkey-patching) or of anything reached through a call. Not caught:
    tampering through objects the checker cannot name statically.
``threads``
    Caught: ``threading``, ``_thread``, ``multiprocessing``, ``concurrent``, ``asyncio``,
    ``torch.multiprocessing``, ``torch.distributed`` and ``os.fork``/``os.spawn*``.
``no-extension-call``
    Caught: a workspace ``model_new.py`` that never imports ``cuda_extension``, a
    single-file one that never calls ``load_inline``, a ``ModelNew`` without ``forward``,
    and a ``forward`` from which no reference to the extension is reachable (directly,
    through ``self`` attributes holding the module or its functions, through methods of
    the class, or through functions and classes of the file, such as an
    ``autograd.Function``). Not caught: a forward that references the extension on a
    branch that never runs; the runtime checks that.
``syntax-error`` / ``missing-modelnew``
    The file does not parse (one violation, with the line), or defines no ``ModelNew``.

C++ (``kernels/*.cu|*.cuh|*.cpp|*.cc|*.h|*.hpp`` and the ``cpp_sources``/``cuda_sources``
strings of ``load_inline``; comments and string literals are blanked first, keeping line
numbers):

``torch-compute-op``
    Caught: qualified ``torch::``/``at::`` names that are not types, dtype/device
    constants, allocation (``empty``, ``zeros``, ``ones``, ``full``, ``from_blob``, their
    ``_like`` forms, ...), views and concatenation (``reshape``, ``permute``, ``cat``,
    ``stack``, ...), ``torch::indexing``, ``torch::autograd``, ``at::parallel_for``, or the stream/guard/handle helpers of ``at::cuda`` (and
    ``at::native::getCudnnHandle``); everything under ``at::native``, ``at::cpu``,
    ``at::cuda::blas``, ``torch::nn`` (including ``torch::nn::functional``) and so on; in
    files that use torch, member calls of well-known ATen compute methods (``.sum(``,
    ``.mm(``, ``.relu_(``, ...; not ``.all(``/``.any(``, which cooperative-groups tiles
    also have). ``c10::`` is allowed; ``at::vec`` is not (its ``Vectorized`` methods are
    ATen's own CPU kernels). Not caught: operators on tensors (``a + b``), and unqualified
    calls after ``using namespace at;``.
``threads``
    Caught: ``std::thread``, ``std::jthread``, ``std::async``, ``std::execution::par``,
    ``pthread_create``, ``fork``/``vfork`` and ``at::launch``. OpenMP is allowed.
``forbidden-library``
    Caught: ``#include`` of anything but the C/C++ standard library, POSIX system
    headers, the CUDA toolkit (runtime, intrinsics, cooperative groups, libcu++, and
    CUB/Thrust, which ship inside the toolkit and are header-only), cuBLAS/cuBLASLt,
    cuDNN, torch/ATen/c10/pybind11/Python headers, OpenMP and SIMD intrinsic headers,
    and files of the solution itself (``binding_registry.h`` included); so cuFFT,
    cuSPARSE, cuSOLVER, host cuRAND, NCCL, CUTLASS/CuTe, Eigen, MKL, oneDNN and
    (C)BLAS are rejected, as are their namespaces and ``cblas_``/``mkl_``/``dnnl_``/...
    calls, and, in ``load_inline``, ``-l`` flags for other libraries and non-CUDA include
    paths. The list is the same for both devices (cuBLAS/cuDNN headers simply fail to
    build on the CPU flavour); allowing CUB and Thrust is a choice made in
    ``_ALLOWED_HEADER_PREFIXES``.
``introspection``
    Caught: ``PYBIND11_MODULE`` in a workspace kernel file (``binding.cpp`` owns the
    module; use ``REGISTER_BINDING``), ``TORCH_LIBRARY*`` op registration (it can replace
    the ops the baseline runs), importing or running Python from C++, ``dlopen``/
    ``dlsym``, ``system``/``popen``/``exec*`` and file I/O (``fopen``, ``std::*fstream``).
"""

from __future__ import annotations

import ast
import bisect
import posixpath
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

__all__ = [
    "ALL_RULES",
    "InlineSource",
    "RULE_FORBIDDEN_IMPORT",
    "RULE_FUNCTIONAL",
    "RULE_INTROSPECTION",
    "RULE_LIBRARY",
    "RULE_MISSING_MODELNEW",
    "RULE_NO_EXTENSION",
    "RULE_REFERENCE_FALLBACK",
    "RULE_SYNTAX",
    "RULE_THREADS",
    "RULE_TORCH_COMPUTE",
    "RULE_TRY_EXCEPT",
    "Violation",
    "check_cpp_source",
    "check_model_new",
    "check_solution",
    "extract_inline_sources",
]

RULE_FORBIDDEN_IMPORT = "forbidden-import"
RULE_REFERENCE_FALLBACK = "reference-fallback"
RULE_TRY_EXCEPT = "try-except-fallback"
RULE_TORCH_COMPUTE = "torch-compute-op"
RULE_FUNCTIONAL = "functional-call"
RULE_INTROSPECTION = "introspection"
RULE_THREADS = "threads"
RULE_NO_EXTENSION = "no-extension-call"
RULE_LIBRARY = "forbidden-library"
RULE_SYNTAX = "syntax-error"
RULE_MISSING_MODELNEW = "missing-modelnew"

ALL_RULES: tuple[str, ...] = (
    RULE_FORBIDDEN_IMPORT,
    RULE_REFERENCE_FALLBACK,
    RULE_TRY_EXCEPT,
    RULE_TORCH_COMPUTE,
    RULE_FUNCTIONAL,
    RULE_INTROSPECTION,
    RULE_THREADS,
    RULE_NO_EXTENSION,
    RULE_LIBRARY,
    RULE_SYNTAX,
    RULE_MISSING_MODELNEW,
)

MODEL_NEW = "model_new.py"
EXTENSION_MODULE = "cuda_extension"
DEVICES = ("cuda", "cpu")
CPP_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".hxx", ".inl")


@dataclass(frozen=True)
class Violation:
    """One broken rule, located in a solution file."""

    rule: str
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line > 0 else self.file
        return f"{where}: [{self.rule}] {self.message}"


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


# ----------------------------------------------------------------------------------------
# Vocabulary shared by the Python and C++ checks
# ----------------------------------------------------------------------------------------

_COMPUTE_BASE = """
abs absolute acos acosh add addbmm addcdiv addcmul addmm addmv addr all allclose amax amin
aminmax angle any apply_ arccos arccosh arcsin arcsinh arctan arctan2 arctanh argmax argmin
argsort asin asinh atan atan2 atanh baddbmm bincount bitwise_and bitwise_left_shift
bitwise_not bitwise_or bitwise_right_shift bitwise_xor bmm ceil cholesky clamp clamp_max
clamp_min clip cos cosh count_nonzero cross cummax cummin cumprod cumsum deg2rad det diag
diff digamma dist div divide dot eq erf erfc erfinv exp exp2 expm1 fix float_power floor
floor_divide fmax fmin fmod frac gather gcd ge gelu ger greater greater_equal gt hardshrink
heaviside histc hypot i0 index_add index_copy index_fill index_put index_reduce index_select
inner inverse isclose isfinite isinf isnan kron kthvalue lcm ldexp le lerp less less_equal
lgamma log log10 log1p log2 log_softmax logaddexp logaddexp2 logcumsumexp logdet logical_and
logical_not logical_or logical_xor logit logsumexp lt lu map_ masked_fill masked_scatter
masked_select matmul matrix_exp matrix_power max maximum mean median min minimum mm mode
msort mul multiply mv mvlgamma nan_to_num nanmean nanmedian nanquantile nansum ne neg negative
nextafter nonzero norm not_equal outer pinverse polygamma pow prelu prod put put_ qr quantile
rad2deg reciprocal relu remainder renorm round rsqrt scatter scatter_add scatter_reduce sgn
sigmoid sign signbit silu sin sinc sinh slogdet softmax sort sqrt square std sub subtract sum
svd take take_along_dim tan tanh topk trace trapz tril triu true_divide trunc unique
unique_consecutive var vdot where xlogy
"""
# In-place variants (``x.add_``) of every compute op, except ones already ending in "_".
COMPUTE_METHODS: frozenset[str] = frozenset(
    {n for n in _COMPUTE_BASE.split()}
    | {n + "_" for n in _COMPUTE_BASE.split() if not n.endswith("_")}
)

# C++ members that also exist outside ATen (cooperative_groups tiles have .all/.any).
CPP_COMPUTE_METHODS: frozenset[str] = COMPUTE_METHODS - {"all", "any"}

_DUNDER_RE = re.compile(r"^__\w+__$")


def _is_dunder(name: str) -> bool:
    return bool(_DUNDER_RE.match(name))


# ----------------------------------------------------------------------------------------
# Python: what may be imported and which torch names are not compute
# ----------------------------------------------------------------------------------------

_ALLOWED_MODULES = frozenset(
    """
    math typing typing_extensions functools dataclasses __future__ collections enum abc
    numbers itertools
    """.split()
)
_THREAD_MODULES = frozenset({"threading", "_thread", "multiprocessing", "concurrent", "asyncio"})

# torch.<name> that create tensors, describe them, or move/view data without arithmetic.
_TORCH_FACTORIES = frozenset(
    """
    empty empty_like empty_strided zeros zeros_like ones ones_like full full_like tensor
    as_tensor as_strided arange linspace logspace eye rand rand_like randn randn_like randint
    randint_like randperm normal scalar_tensor
    reshape flatten unflatten permute transpose t unsqueeze squeeze narrow select split
    tensor_split chunk unbind movedim moveaxis swapaxes swapdims view_as_real view_as_complex
    broadcast_to broadcast_tensors cat concat concatenate stack clone detach atleast_1d
    atleast_2d atleast_3d
    """.split()
)
_TORCH_DTYPES = frozenset(
    """
    float32 float float16 half bfloat16 float64 double int8 int16 short int32 int int64 long
    uint8 uint16 uint32 uint64 bool complex32 chalf complex64 cfloat complex128 cdouble
    float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2
    qint8 quint8 qint32 quint4x2 bits8 strided sparse_coo sparse_csr contiguous_format
    channels_last channels_last_3d preserve_format
    """.split()
)
_TORCH_OTHER_ALLOWED = frozenset(
    """
    Tensor Size dtype device Generator layout memory_format finfo iinfo Stream Event
    manual_seed seed initial_seed get_rng_state set_rng_state random
    is_tensor is_floating_point is_complex is_grad_enabled is_inference_mode_enabled
    is_storage numel get_default_dtype set_default_dtype promote_types result_type can_cast
    broadcast_shapes typename no_grad enable_grad inference_mode set_grad_enabled autocast
    get_num_threads set_num_threads get_num_interop_threads set_num_interop_threads
    use_deterministic_algorithms are_deterministic_algorithms_enabled
    set_float32_matmul_precision get_float32_matmul_precision backends version types
    get_device is_nonzero
    """.split()
)
_TORCH_ALLOWED_TOP = _TORCH_FACTORIES | _TORCH_DTYPES | _TORCH_OTHER_ALLOWED
_TORCH_TAMPER = frozenset(
    {"ops", "library", "overrides", "fx", "export", "package", "hub", "classes", "func", "masked"}
)
_TORCH_AUTOGRAD_ALLOWED = frozenset(
    """
    Function function grad_mode no_grad enable_grad set_grad_enabled inference_mode
    Variable once_differentiable
    """.split()
)
_TORCH_CUDA_FORBIDDEN = frozenset({"jiterator", "comm", "nccl"})
_NN_NOT_LAYERS = frozenset(
    """
    Parameter ParameterList ParameterDict ModuleList ModuleDict Module Identity Buffer
    UninitializedParameter UninitializedBuffer
    """.split()
)
_NN_ALLOWED_SUBMODULES = frozenset({"init", "parameter", "modules", "utils"})
_ALLOWED_ATTR_DUNDERS = frozenset(
    {"__init__", "__name__", "__qualname__", "__doc__", "__version__"}
)
_ALLOWED_NAME_DUNDERS = frozenset({"__name__", "__file__", "__doc__"})
_ALLOWED_DEF_DUNDERS = frozenset({"__init__", "__repr__", "__str__", "__post_init__"})
_DANGEROUS_BUILTINS = frozenset(
    """
    exec eval compile __import__ globals locals vars setattr delattr open input
    breakpoint getattr
    """.split()
)
_REFERENCE_NAMES = frozenset({"Model", "get_inputs", "get_init_inputs"})
_TENSOR_BUILTINS = frozenset({"abs", "sum", "max", "min", "pow", "round", "divmod"})
# Methods whose result is a tensor when the receiver is one (views, casts, copies).
_TENSOR_PRESERVING_METHODS = frozenset(
    """
    view view_as reshape reshape_as contiguous permute transpose t unsqueeze squeeze flatten
    unflatten expand expand_as narrow select detach clone to cuda cpu float half double
    bfloat16 int long short bool byte char type_as new_empty new_zeros new_ones new_full
    new_tensor movedim swapaxes swapdims repeat repeat_interleave as_strided split chunk
    unbind tensor_split pin_memory requires_grad_ fill_ zero_ copy_ uniform_ normal_ flip
    roll diagonal mT
    """.split()
)
_TENSOR_ATTRS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag", "grad"})
_NON_TENSOR_CALLS = frozenset(
    """
    list dict set tuple sorted len range int float str bool enumerate zip reversed map
    filter frozenset
    """.split()
)
_NON_TENSOR_METHODS = frozenset(
    {"size", "tolist", "item", "numel", "dim", "stride", "element_size", "data_ptr", "nelement"}
)
_NON_TENSOR_ANNOTATIONS = frozenset(
    {"int", "float", "bool", "str", "list", "tuple", "dict", "bytes", "complex", "None"}
)
_OS_ALLOWED = ("os.environ", "os.getenv", "os.path", "os.sep", "os.pathsep", "os.linesep")
_OS_THREADS = ("os.fork", "os.forkpty", "os.spawn", "os.posix_spawn", "os.register_at_fork")
_LOAD_INLINE = "torch.utils.cpp_extension.load_inline"


def _under(dotted: str, prefixes: Iterable[str]) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in prefixes)


_ALLOWED_LINK_LIBS = frozenset(
    """
    cublas cublasLt cudnn cudart cudart_static cuda c10 c10_cuda torch torch_cpu
    torch_cuda torch_python stdc++ m gomp omp iomp5 pthread dl rt
    """.split()
)


def _compute_message(shown: str) -> str:
    return f"`{shown}` computes in PyTorch; do this computation in your extension kernel instead."


def _classify_torch(dotted: str, *, single_file: bool) -> tuple[str, str] | None:
    """Rule and message for a resolved ``torch...`` name, or None when it is allowed."""
    parts = dotted.split(".")
    if len(parts) < 2:
        return None
    for part in parts[1:]:
        if part.startswith("_") and not _is_dunder(part):
            return (
                RULE_INTROSPECTION,
                f"`{dotted}` reaches into private torch internals; use only public tensor "
                "creation and metadata APIs plus your extension.",
            )
    p1 = parts[1]
    if _is_dunder(p1):
        return None  # reported by the dunder-attribute check unless allowed
    if p1 == "utils":
        if single_file and dotted in (
            "torch.utils.cpp_extension",
            _LOAD_INLINE,
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
        return (RULE_INTROSPECTION, msg)
    if p1 in _TORCH_TAMPER:
        return (
            RULE_INTROSPECTION,
            f"`{dotted}` reaches PyTorch's operator/dispatch machinery; call the functions of "
            "your extension module directly instead.",
        )
    if p1 in ("multiprocessing", "distributed"):
        return (
            RULE_THREADS,
            f"`{dotted}` starts extra processes or workers; run all work in the calling "
            "thread through your extension.",
        )
    if p1 in ("compile", "jit"):
        return (
            RULE_TORCH_COMPUTE,
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
                RULE_FUNCTIONAL,
                f"`{dotted}` {what} blocked while ModelNew runs; implement the operation in "
                "your kernel instead.",
            )
        if p2 in _NN_ALLOWED_SUBMODULES:
            return None
        if p2[:1].isupper():
            if len(parts) > 3 and parts[3] == "forward":
                return (RULE_TORCH_COMPUTE, _compute_message(dotted))
            return None
        return (RULE_TORCH_COMPUTE, _compute_message(dotted))
    if p1 == "cuda":
        if len(parts) > 2 and parts[2] in _TORCH_CUDA_FORBIDDEN:
            return (RULE_TORCH_COMPUTE, _compute_message(dotted))
        return None
    if p1 == "autograd":
        if len(parts) == 2 or parts[2] in _TORCH_AUTOGRAD_ALLOWED:
            return None
        return (RULE_TORCH_COMPUTE, _compute_message(dotted))
    if p1 == "Tensor":
        if len(parts) > 2 and parts[2] in COMPUTE_METHODS:
            return (RULE_TORCH_COMPUTE, _compute_message(dotted))
        return None
    if p1 in _TORCH_ALLOWED_TOP:
        return None
    return (RULE_TORCH_COMPUTE, _compute_message(dotted))


# ----------------------------------------------------------------------------------------
# Python checker
# ----------------------------------------------------------------------------------------


@dataclass
class _ClassInfo:
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    layer_attrs: dict[str, str] = field(default_factory=dict)  # attr -> torch.nn class
    tensor_attrs: set[str] = field(default_factory=set)
    torch_layer_base: bool = False
    autograd_function: bool = False


@dataclass
class _Scope:
    func: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    cls: _ClassInfo | None = None
    tensors: set[str] = field(default_factory=set)
    non_tensors: set[str] = field(default_factory=set)
    layers: dict[str, str] = field(default_factory=dict)  # local name -> torch.nn class
    init: bool = False  # directly inside __init__: only clear-cut compute is flagged
    exempt: bool = False  # autograd backward: compute rules off


def _root_name(node: ast.expr) -> ast.Name | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def _is_self_attr(node: ast.expr, attrs: Collection[str] | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (attrs is None or node.attr in attrs)
    )


def _str_const(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _assigned_targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
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


class _PythonChecker(ast.NodeVisitor):
    def __init__(self, source: str, tree: ast.Module, filename: str, single_file: bool) -> None:
        self.source = source
        self.tree = tree
        self.filename = filename
        self.single_file = single_file
        self.violations: list[Violation] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.aliases: dict[str, str] = {}
        self._collect_aliases()
        self.module_defs: dict[str, ast.AST] = {}
        self.bound_names: set[str] = set()
        self._collect_module_bindings()
        self.docstrings = self._collect_docstrings()
        self.classes: dict[str, _ClassInfo] = {}
        self._collect_classes()
        self.ext_aliases: set[str] = set()
        self.ext_self_attrs: set[str] = set()
        self.ext_factories: set[str] = set()
        self.load_inline_calls: list[ast.Call] = []
        self._discover_extension()
        self.scope = _Scope()
        self.in_main_guard = False

    # -- helpers -------------------------------------------------------------------------

    def add(self, rule: str, node: ast.AST | int, message: str) -> None:
        line = node if isinstance(node, int) else getattr(node, "lineno", 0)
        self.violations.append(Violation(rule, self.filename, line, message))

    def src(self, node: ast.AST, limit: int = 60) -> str:
        text = ast.get_source_segment(self.source, node) or ast.unparse(node)
        text = " ".join(text.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def dotted(self, node: ast.expr) -> str | None:
        """Fully qualified name of a module member expression, through import aliases."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        if self._is_literal_getattr(node):
            assert isinstance(node, ast.Call)
            base = self.dotted(node.args[0])
            attr = _str_const(node.args[1])
            return f"{base}.{attr}" if base else None
        return None

    def _is_literal_getattr(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and "getattr" not in self.bound_names
            and len(node.args) >= 2
            and _str_const(node.args[1]) is not None
        )

    # -- pre-passes ----------------------------------------------------------------------

    def _collect_aliases(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if a.name != "*":
                        self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

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
                    if isinstance(stmt, ast.Expr) and _str_const(stmt.value) is not None:
                        ids.add(id(stmt.value))
        return ids

    def _collect_classes(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                info = _ClassInfo(node)
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
                        and parts[2] not in _NN_NOT_LAYERS
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

    def _nn_layer_class(self, node: ast.expr | None) -> str | None:
        """'Conv2d' when ``node`` constructs a torch.nn layer whose call computes in torch."""
        if not isinstance(node, ast.Call):
            return None
        dotted = self.dotted(node.func) or ""
        parts = dotted.split(".")
        if len(parts) != 3 or parts[:2] != ["torch", "nn"] or not parts[2][:1].isupper():
            return None
        name = parts[2]
        if name in _NN_NOT_LAYERS:
            return None
        if name == "Sequential":
            return name if any(self._nn_layer_class(a) for a in node.args) else None
        return name

    def _collect_class_attrs(self, info: _ClassInfo) -> None:
        for node in ast.walk(info.node):
            for target, value in _assigned_targets(node):
                if not _is_self_attr(target):
                    continue
                assert isinstance(target, ast.Attribute)
                layer = self._nn_layer_class(value)
                if layer:
                    info.layer_attrs[target.attr] = layer
                elif isinstance(value, ast.Call):
                    dotted = self.dotted(value.func) or ""
                    if dotted in ("torch.nn.Parameter", "torch.nn.Buffer") or (
                        dotted.startswith("torch.") and dotted[6:] in _TORCH_FACTORIES
                    ):
                        info.tensor_attrs.add(target.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("register_buffer", "register_parameter")
                and node.args
                and _str_const(node.args[0])
            ):
                info.tensor_attrs.add(_str_const(node.args[0]) or "")

    def _is_load_inline(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and self.dotted(node.func) == _LOAD_INLINE

    def _is_ext_alias_expr(self, node: ast.expr | None) -> bool:
        """True for expressions that evaluate to the extension module or one of its members."""
        if node is None:
            return False
        if self.single_file and self._is_load_inline(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.ext_aliases
        if isinstance(node, ast.Attribute):
            if _is_self_attr(node, self.ext_self_attrs):
                return True
            return self._is_ext_alias_expr(node.value)
        if isinstance(node, ast.Call):
            if self._is_literal_getattr(node):
                return self._is_ext_alias_expr(node.args[0])
            return isinstance(node.func, ast.Name) and node.func.id in self.ext_factories
        return False

    def _discover_extension(self) -> None:
        if not self.single_file:
            for name, target in self.aliases.items():
                if target == EXTENSION_MODULE or target.startswith(EXTENSION_MODULE + "."):
                    self.ext_aliases.add(name)
        self.load_inline_calls = [n for n in ast.walk(self.tree) if self._is_load_inline(n)]
        for _ in range(6):
            before = (len(self.ext_aliases), len(self.ext_self_attrs), len(self.ext_factories))
            for node in ast.walk(self.tree):
                for target, value in _assigned_targets(node):
                    if not self._is_ext_alias_expr(value):
                        continue
                    if isinstance(target, ast.Name):
                        self.ext_aliases.add(target.id)
                    elif _is_self_attr(target):
                        assert isinstance(target, ast.Attribute)
                        self.ext_self_attrs.add(target.attr)
            for name, fn in self.module_defs.items():
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for sub in ast.walk(fn):
                    if (self.single_file and self._is_load_inline(sub)) or (
                        isinstance(sub, ast.Return) and self._is_ext_alias_expr(sub.value)
                    ):
                        self.ext_factories.add(name)
                        break
            after = (len(self.ext_aliases), len(self.ext_self_attrs), len(self.ext_factories))
            if after == before:
                break

    def _is_ext_call(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Call) and self._is_ext_alias_expr(node.func)

    # -- tensor inference ----------------------------------------------------------------

    def is_tensor(self, node: ast.expr, scope: _Scope | None = None) -> bool:
        scope = scope or self.scope
        if isinstance(node, ast.Name):
            return node.id in scope.tensors
        if isinstance(node, ast.Attribute):
            if scope.cls and _is_self_attr(node, scope.cls.tensor_attrs):
                return True
            if node.attr in ("weight", "bias") and self._layer_of(node.value, scope):
                return True
            return node.attr in _TENSOR_ATTRS and self.is_tensor(node.value, scope)
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value, scope) or self._is_ext_call(node.value)
        if isinstance(node, ast.Call):
            if self._is_ext_call(node):
                return True
            dotted = self.dotted(node.func) or ""
            if dotted.startswith("torch.") and dotted[6:] in _TORCH_FACTORIES:
                return True
            if isinstance(node.func, ast.Attribute) and (
                node.func.attr in _TENSOR_PRESERVING_METHODS or node.func.attr in COMPUTE_METHODS
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

    def _layer_of(self, node: ast.expr, scope: _Scope) -> str | None:
        if scope.cls and _is_self_attr(node, scope.cls.layer_attrs):
            assert isinstance(node, ast.Attribute)
            return scope.cls.layer_attrs[node.attr]
        if isinstance(node, ast.Name):
            return scope.layers.get(node.id)
        return None

    def _is_non_tensor_value(self, value: ast.expr) -> bool:
        if isinstance(
            value,
            (
                ast.List,
                ast.Tuple,
                ast.Set,
                ast.Dict,
                ast.ListComp,
                ast.SetComp,
                ast.DictComp,
                ast.GeneratorExp,
                ast.JoinedStr,
                ast.Constant,
            ),
        ):
            return True
        if isinstance(value, ast.Call):
            if isinstance(value.func, ast.Name) and value.func.id in _NON_TENSOR_CALLS:
                return True
            if isinstance(value.func, ast.Attribute) and value.func.attr in _NON_TENSOR_METHODS:
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
        if names and names <= _NON_TENSOR_ANNOTATIONS | {"List", "Tuple", "Dict", "Sequence"}:
            return False
        return None

    def _function_scope(
        self,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        cls: _ClassInfo | None,
        outer: _Scope,
    ) -> _Scope:
        scope = _Scope(func=fn, cls=cls)
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
                for target, value in _assigned_targets(node):
                    if not isinstance(target, ast.Name) or value is None:
                        continue
                    if isinstance(node, ast.AugAssign) and target.id in scope.tensors:
                        continue
                    if self.is_tensor(value, scope):
                        scope.tensors.add(target.id)
                    elif self._is_non_tensor_value(value):
                        scope.non_tensors.add(target.id)
                    layer = self._nn_layer_class(value) or self._layer_of(value, scope)
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

    # -- imports -------------------------------------------------------------------------

    def _check_module_path(self, path: str, node: ast.AST) -> None:
        root = path.split(".")[0]
        if root == "model":
            self.add(
                RULE_REFERENCE_FALLBACK,
                node,
                f"importing `{path}` uses the reference implementation; ModelNew must compute "
                "everything through your own kernels.",
            )
            return
        if root == "torch":
            verdict = _classify_torch(path, single_file=self.single_file)
            if verdict:
                self.add(verdict[0], node, verdict[1])
            return
        if root == EXTENSION_MODULE:
            if self.single_file:
                self.add(
                    RULE_FORBIDDEN_IMPORT,
                    node,
                    f"`import {EXTENSION_MODULE}` belongs to the workspace format; a "
                    "single-file solution builds its own module with `load_inline`.",
                )
            return
        if root in _ALLOWED_MODULES:
            return
        if root in _THREAD_MODULES:
            self.add(
                RULE_THREADS,
                node,
                f"`{path}` runs work on other threads or processes; launch your kernels from "
                "the calling thread instead.",
            )
            return
        if root == "os" and self.single_file:
            if path == "os" or _under(path, _OS_ALLOWED):
                return
            self._check_os(path, node)
            return
        allowed = "torch, torch.nn, math, typing, functools, dataclasses, collections"
        allowed += ", torch.utils.cpp_extension.load_inline, os" if self.single_file else ""
        allowed += "" if self.single_file else f", {EXTENSION_MODULE}"
        self.add(
            RULE_FORBIDDEN_IMPORT,
            node,
            f"importing `{path}` is not allowed in {self.filename}; use only {allowed}.",
        )

    def _check_os(self, dotted: str, node: ast.AST) -> None:
        if _under(dotted, _OS_ALLOWED):
            return
        if dotted.startswith(_OS_THREADS):
            self.add(
                RULE_THREADS,
                node,
                f"`{dotted}` starts another process; run everything in the calling process.",
            )
            return
        self.add(
            RULE_FORBIDDEN_IMPORT,
            node,
            f"`{dotted}` is not allowed; a single-file solution may use os only for "
            "os.environ, os.getenv and os.path.",
        )

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._check_module_path(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            names = [node.module or ""] + [a.name for a in node.names]
            if any("model" in n.split(".")[0] for n in names if n):
                self.add(
                    RULE_REFERENCE_FALLBACK,
                    node,
                    "a relative import of the task's model uses the reference implementation; "
                    "ModelNew must compute everything through your own kernels.",
                )
            else:
                self.add(
                    RULE_FORBIDDEN_IMPORT,
                    node,
                    f"relative imports are not allowed; a solution's only Python file is "
                    f"{MODEL_NEW}.",
                )
            return
        module = node.module or ""
        for a in node.names:
            if a.name == "*":
                root = module.split(".")[0]
                if root in _ALLOWED_MODULES:
                    continue
                self.add(
                    RULE_FORBIDDEN_IMPORT,
                    node,
                    f"`from {module} import *` hides which names are used; import the names "
                    "you need explicitly.",
                )
                continue
            self._check_module_path(f"{module}.{a.name}", node)

    # -- structure -----------------------------------------------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        info = self.classes.get(node.name)
        saved = self.scope
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._check_def_name(stmt, node.name)
        for expr in [*node.bases, *node.decorator_list]:
            self.visit(expr)
        for kw in node.keywords:
            self.visit(kw)
        self.scope = _Scope(cls=info, tensors=set(saved.tensors), exempt=saved.exempt)
        for stmt in node.body:
            self.visit(stmt)
        self.scope = saved

    def _check_def_name(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: str) -> None:
        if _is_dunder(fn.name) and fn.name not in _ALLOWED_DEF_DUNDERS:
            self.add(
                RULE_INTROSPECTION,
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
        self.scope = self._function_scope(node, saved.cls if saved.func is None else None, saved)
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
            and _str_const(test.comparators[0]) == "__main__"
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
                RULE_TRY_EXCEPT,
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
        if name in _REFERENCE_NAMES and not self.in_main_guard:
            self.add(
                RULE_REFERENCE_FALLBACK,
                node,
                f"`{name}` belongs to the reference task; ModelNew must not use it and must "
                "compute through your own kernels.",
            )
        elif name in _DANGEROUS_BUILTINS and name not in self.bound_names:
            parent = self.parents.get(node)
            if name == "getattr" and isinstance(parent, ast.Call) and parent.func is node:
                if self._is_literal_getattr(parent):
                    return
                self.add(
                    RULE_INTROSPECTION,
                    node,
                    "`getattr` with a computed attribute name hides what is accessed; use "
                    "plain attribute access or a string literal.",
                )
                return
            self.add(
                RULE_INTROSPECTION,
                node,
                f"the builtin `{name}` is not allowed in {self.filename} (dynamic code, "
                "file access or attribute tampering); write plain code that calls your "
                "extension.",
            )
        elif _is_dunder(name) and name not in _ALLOWED_NAME_DUNDERS:
            self.add(
                RULE_INTROSPECTION,
                node,
                f"`{name}` reaches interpreter internals; remove it and write plain code.",
            )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        parent = self.parents.get(node)
        maximal = not (isinstance(parent, ast.Attribute) and parent.value is node)
        dotted = self.dotted(node) if maximal else None
        if _is_dunder(attr):
            if attr not in _ALLOWED_ATTR_DUNDERS:
                self.add(
                    RULE_INTROSPECTION,
                    node,
                    f"`{self.src(node)}` accesses the dunder attribute {attr}; use ordinary "
                    "attributes and your extension's functions instead.",
                )
        elif attr.startswith("_") and not (self.dotted(node) or "").startswith("torch."):
            receiver = node.value
            own = isinstance(receiver, ast.Name) and (
                receiver.id in ("self", "cls") or receiver.id in self.classes
            )
            if not own:
                self.add(
                    RULE_INTROSPECTION,
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
            verdict = _classify_torch(dotted, single_file=self.single_file)
            if not verdict:
                return
            rule, message = verdict
            if rule in (RULE_TORCH_COMPUTE, RULE_FUNCTIONAL) and self.scope.exempt:
                return
            if rule == RULE_TORCH_COMPUTE and self.scope.init:
                return  # weights and buffers built here are replaced by load_state_dict
            shown = self.src(node)
            if shown != dotted:
                message = message.replace(f"`{dotted}`", f"`{shown}` ({dotted})", 1)
            self.add(rule, node, message)
        elif root == "os" and self.single_file:
            self._check_os(dotted, node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if (
            isinstance(node.value, str)
            and id(node) not in self.docstrings
            and re.search(r"\bmodel\.py\b", node.value)
        ):
            self.add(
                RULE_REFERENCE_FALLBACK,
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
            dotted = self.dotted(target.value) or ""
            if dotted and not dotted.startswith("os.environ"):
                self.add(
                    RULE_INTROSPECTION,
                    target,
                    f"assigning into `{self.src(target)}` modifies a module's state; keep "
                    "state on self and leave modules untouched.",
                )
            return
        if not isinstance(target, ast.Attribute):
            return
        root = _root_name(target)
        if _is_dunder(target.attr):
            return  # reported as a dunder attribute access
        patched = root is None or (
            root.id not in ("self", "cls", "ctx")
            and (
                root.id in self.aliases
                or root.id in self.module_defs
                or root.id in self.ext_aliases
            )
        )
        if patched:
            self.add(
                RULE_INTROSPECTION,
                target,
                f"assigning `{self.src(target)}` monkey-patches an object this file does not "
                "own; keep state on self and call your extension directly.",
            )

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_store_target(t)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_store_target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._check_store_target(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store_target(node.target)
        if self._operators_checked() and (
            isinstance(node.op, ast.MatMult)
            or self.is_tensor(node.target)
            or self.is_tensor(node.value)
        ):
            self.add(
                RULE_TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` applies a PyTorch operator to a tensor; compute it in "
                "your extension kernel instead.",
            )
        self.generic_visit(node)

    # -- operators -----------------------------------------------------------------------

    def _operators_checked(self) -> bool:
        return self.scope.func is not None and not self.scope.init and not self.scope.exempt

    def visit_BinOp(self, node: ast.BinOp) -> None:
        parent = self.parents.get(node)
        nested = isinstance(parent, ast.BinOp)
        if isinstance(node.op, ast.MatMult):
            if not (self.scope.exempt or self.scope.init) and not (
                nested and isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult)
            ):
                self.add(
                    RULE_TORCH_COMPUTE,
                    node,
                    f"`{self.src(node)}` is a PyTorch matrix multiply (@); write the GEMM in "
                    "your extension instead.",
                )
        elif self._operators_checked() and self.is_tensor(node):
            parent_flagged = (
                nested
                and isinstance(parent, ast.BinOp)
                and not isinstance(parent.op, ast.MatMult)
                and self.is_tensor(parent)
            )
            has_matmul = any(
                isinstance(side, ast.BinOp) and isinstance(side.op, ast.MatMult)
                for side in (node.left, node.right)
            )
            if not parent_flagged and not has_matmul and not self._inside_matmul(node):
                self.add(
                    RULE_TORCH_COMPUTE,
                    node,
                    f"`{self.src(node)}` applies a PyTorch operator to tensors; compute it in "
                    "your extension kernel instead.",
                )
        self.generic_visit(node)

    def _inside_matmul(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        while isinstance(parent, ast.BinOp):
            if isinstance(parent.op, ast.MatMult):
                return True
            parent = self.parents.get(parent)
        return False

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if (
            self._operators_checked()
            and not isinstance(node.op, ast.Not)
            and self.is_tensor(node.operand)
            and not isinstance(self.parents.get(node), ast.BinOp)
        ):
            self.add(
                RULE_TORCH_COMPUTE,
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
            and any(self.is_tensor(e) for e in [node.left, *node.comparators])
        ):
            self.add(
                RULE_TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` compares tensors elementwise in PyTorch; compute it in "
                "your extension kernel instead.",
            )
        self.generic_visit(node)

    # -- calls ---------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        scope = self.scope
        checked = scope.func is not None and not scope.init and not scope.exempt
        if self._is_literal_getattr(node):
            dotted = self.dotted(node)
            attr = _str_const(node.args[1]) or ""
            if dotted:
                self._check_dotted(dotted, node)
            elif _is_dunder(attr) and attr not in _ALLOWED_ATTR_DUNDERS:
                self.add(
                    RULE_INTROSPECTION,
                    node,
                    f"`{self.src(node)}` accesses the dunder attribute {attr}; use ordinary "
                    "attributes instead.",
                )
        if self._is_load_inline(node):
            self._check_load_inline_flags(node)
        if checked:
            self._check_call_compute(node)
        elif not scope.exempt and isinstance(func, ast.Call) and self._nn_layer_class(func):
            self.add(RULE_TORCH_COMPUTE, node, self._layer_message(node))
        self.generic_visit(node)

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
        if isinstance(func, ast.Call) and self._nn_layer_class(func):
            self.add(RULE_TORCH_COMPUTE, node, self._layer_message(node))
            return
        layer = self._layer_of(func, scope)
        target = func
        if (
            layer is None
            and isinstance(func, ast.Attribute)
            and func.attr in ("forward", "__call__")
        ):
            layer = self._layer_of(func.value, scope)
            target = func.value
        if layer:
            self.add(
                RULE_TORCH_COMPUTE,
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
                RULE_TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` runs the inherited torch.nn layer, which computes in "
                "PyTorch; compute with your extension instead.",
            )
            return
        # Builtins applied to tensors.
        if (
            isinstance(func, ast.Name)
            and func.id in _TENSOR_BUILTINS
            and func.id not in self.bound_names
            and any(self.is_tensor(a) for a in node.args)
        ):
            self.add(
                RULE_TORCH_COMPUTE,
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
                RULE_TORCH_COMPUTE,
                node,
                f"`{self.src(node)}` calls the tensor method .{func.attr}(), which computes in "
                "PyTorch; do it in your extension kernel instead.",
            )

    def _skip_method_receiver(self, recv: ast.expr) -> bool:
        scope = self.scope
        if isinstance(
            recv,
            (
                ast.Constant,
                ast.List,
                ast.Tuple,
                ast.Set,
                ast.Dict,
                ast.ListComp,
                ast.SetComp,
                ast.DictComp,
                ast.JoinedStr,
            ),
        ):
            return True
        if (
            isinstance(recv, ast.Call)
            and isinstance(recv.func, ast.Name)
            and (recv.func.id == "super" or recv.func.id in _NON_TENSOR_CALLS)
        ):
            return True
        if self.dotted(recv) is not None or self._is_ext_alias_expr(recv):
            return True  # module members are judged by their qualified name
        if isinstance(recv, ast.Name):
            name = recv.id
            if name in ("self", "cls") or name in self.module_defs or name in self.classes:
                return True
            if name in scope.non_tensors and name not in scope.tensors:
                return True
        return False

    def _check_load_inline_flags(self, node: ast.Call) -> None:
        headers = "only the CUDA toolkit, cuBLAS, cuDNN and torch headers may be used"
        for kw in node.keywords:
            if not isinstance(kw.value, (ast.List, ast.Tuple)):
                continue
            for elt in kw.value.elts:
                flag = _str_const(elt)
                if flag is None:
                    continue  # computed flags are left to the build
                if kw.arg == "extra_include_paths" and "cuda" not in flag.lower():
                    self.add(
                        RULE_LIBRARY,
                        elt,
                        f"the include path `{flag}` brings in third-party headers; {headers}.",
                    )
                if kw.arg == "extra_ldflags":
                    for lib in re.findall(r"(?:^|\s)-l\s*([\w+.-]+)", flag):
                        if lib not in _ALLOWED_LINK_LIBS:
                            self.add(
                                RULE_LIBRARY,
                                elt,
                                f"linking `-l{lib}` brings in a third-party library; only "
                                "cuBLAS and cuDNN may be linked.",
                            )
                if kw.arg in ("extra_cflags", "extra_cuda_cflags"):
                    for path in re.findall(r"(?:^|\s)-(?:I|isystem)\s*(\S+)", flag):
                        if "cuda" not in path.lower():
                            self.add(
                                RULE_LIBRARY,
                                elt,
                                f"the include flag `{flag}` brings in third-party headers; "
                                f"{headers}.",
                            )

    # -- extension reachability ----------------------------------------------------------

    def check_extension_use(self) -> None:
        model_new = next(
            (
                s
                for s in reversed(self.tree.body)
                if isinstance(s, ast.ClassDef) and s.name == "ModelNew"
            ),
            None,
        )
        if model_new is None:
            aliased = any(
                isinstance(t, ast.Name) and t.id == "ModelNew"
                for s in self.tree.body
                for t, _ in _assigned_targets(s)
            )
            if not aliased:
                self.add(
                    RULE_MISSING_MODELNEW,
                    0,
                    f"{self.filename} defines no `class ModelNew`; define it with the same "
                    "constructor arguments as Model.",
                )
            return
        if not self.ext_aliases and not self.load_inline_calls:
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
            self.add(RULE_NO_EXTENSION, model_new, msg)
            return
        info = self.classes.get("ModelNew")
        forward = info.methods.get("forward") if info else None
        if forward is None:
            self.add(
                RULE_NO_EXTENSION,
                model_new,
                "ModelNew defines no `forward`; define forward and call your extension in it.",
            )
            return
        if not self._reaches_extension(forward, "ModelNew"):
            name = "the module returned by load_inline" if self.single_file else EXTENSION_MODULE
            self.add(
                RULE_NO_EXTENSION,
                forward,
                f"ModelNew.forward never calls {name}; route the computation through your "
                "compiled kernels.",
            )

    def _reaches_extension(self, start: ast.AST, cls_name: str) -> bool:
        """Whether an extension reference is reachable from ``start`` (over-approximate)."""
        reaching_defs: set[str] = set()
        reaching_attrs: set[str] = set(self.ext_self_attrs)
        reaching_methods: dict[str, set[str]] = {}

        def refs(node: ast.AST, owner: str | None) -> bool:
            for sub in ast.walk(node):
                if self.single_file and self._is_load_inline(sub):
                    return True
                if isinstance(sub, ast.Name) and (
                    sub.id in self.ext_aliases or sub.id in reaching_defs
                ):
                    return True
                if isinstance(sub, ast.Attribute) and _is_self_attr(sub):
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
                for target, value in _assigned_targets(node):
                    if value is not None and _is_self_attr(target) and refs(value, owner_of(node)):
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
                    RULE_SYNTAX,
                    filename,
                    0,
                    f"{filename} could not be parsed ({type(exc).__name__}); simplify it.",
                )
            ]
        return [
            Violation(
                RULE_SYNTAX,
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
                RULE_SYNTAX,
                filename,
                0,
                f"{filename} nests expressions too deeply to be checked; split long "
                "expressions into separate statements.",
            )
        ]
    return _dedupe(checker.violations)


# ----------------------------------------------------------------------------------------
# load_inline sources
# ----------------------------------------------------------------------------------------

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
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
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
        if not (isinstance(node, ast.Call) and dotted(node.func) == _LOAD_INLINE):
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


# ----------------------------------------------------------------------------------------
# C++ checker
# ----------------------------------------------------------------------------------------


def _blank(seg: str) -> str:
    return re.sub(r"[^\n]", " ", seg)


def _quoted_end(src: str, i: int, quote: str) -> int:
    """Index just past the literal opened by `quote` at i (ends at the line's end if unclosed)."""
    j, n = i + 1, len(src)
    while j < n and src[j] != quote and src[j] != "\n":
        j += 2 if src[j] == "\\" else 1
    return min(j + 1, n)


def _keep_literal(seg: str, quote: str, no_comments: list[str], code: list[str]) -> None:
    """A literal stays in the comment-free text; in the code-only text its inside is blanked."""
    no_comments.append(seg)
    code.append(quote + _blank(seg[1:-1]) + quote if len(seg) >= 2 else _blank(seg))


def _strip_cpp(src: str) -> tuple[str, str]:
    """(source without comments, source without comments and string/char literals).

    Removed text is replaced by spaces so offsets and line numbers stay valid.
    """
    no_comments: list[str] = []
    code: list[str] = []
    i, n = 0, len(src)

    while i < n:
        c = src[i]
        if c == "/" and src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j == -1 else j
            no_comments.append(_blank(src[i:j]))
            code.append(_blank(src[i:j]))
            i = j
            continue
        if c == "/" and src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j == -1 else j + 2
            no_comments.append(_blank(src[i:j]))
            code.append(_blank(src[i:j]))
            i = j
            continue
        if c == '"':
            prefix = re.search(r"(?<![\w])(u8|u|U|L)?R$", src[max(0, i - 3) : i])
            m = re.match(r'"([^()\\\s]{0,16})\(', src[i:]) if prefix else None
            if m:
                end = src.find(")" + m.group(1) + '"', i + m.end())
                j = n if end == -1 else end + len(m.group(1)) + 2
            else:
                j = _quoted_end(src, i, '"')
            _keep_literal(src[i:j], '"', no_comments, code)
            i = j
            continue
        if c == "'":
            token = re.search(r"\w*$", src[max(0, i - 32) : i])
            word = token.group(0) if token else ""
            if word and word[0].isdigit():  # digit separator: 1'000'000
                no_comments.append(c)
                code.append(c)
                i += 1
                continue
            j = _quoted_end(src, i, "'")
            _keep_literal(src[i:j], "'", no_comments, code)
            i = j
            continue
        no_comments.append(c)
        code.append(c)
        i += 1
    return "".join(no_comments), "".join(code)


_STD_HEADERS = frozenset(
    """
    algorithm any array atomic barrier bit bitset cassert ccomplex cctype cerrno cfenv cfloat
    charconv chrono cinttypes ciso646 climits clocale cmath codecvt compare complex concepts
    condition_variable coroutine csetjmp csignal cstdalign cstdarg cstdbool cstddef cstdint
    cstdio cstdlib cstring ctgmath ctime cuchar cwchar cwctype deque exception execution
    expected filesystem format forward_list fstream functional future initializer_list iomanip
    ios iosfwd iostream istream iterator latch limits list locale map mdspan memory
    memory_resource mutex new numbers numeric optional ostream print queue random ranges ratio
    regex scoped_allocator semaphore set shared_mutex source_location span sstream stack
    stdexcept stdfloat stop_token streambuf string string_view strstream syncstream
    system_error thread tuple type_traits typeindex typeinfo unordered_map unordered_set
    utility valarray variant vector version
    assert.h complex.h ctype.h errno.h fenv.h float.h inttypes.h iso646.h limits.h locale.h
    math.h setjmp.h signal.h stdalign.h stdarg.h stdatomic.h stdbool.h stddef.h stdint.h
    stdio.h stdlib.h string.h tgmath.h threads.h time.h uchar.h wchar.h wctype.h
    unistd.h pthread.h dlfcn.h fcntl.h sched.h alloca.h malloc.h strings.h cpuid.h
    omp.h arm_neon.h arm_sve.h arm_fp16.h arm_bf16.h Python.h
    """.split()
)
_CUDA_HEADERS = frozenset(
    """
    cuda.h mma.h device_launch_parameters.h device_functions.h device_types.h
    device_atomic_functions.h math_constants.h math_functions.h vector_types.h
    vector_functions.h driver_types.h driver_functions.h host_defines.h host_config.h
    builtin_types.h channel_descriptor.h texture_types.h surface_types.h
    texture_fetch_functions.h surface_functions.h library_types.h cuComplex.h cudaTypedefs.h
    nvToolsExt.h cooperative_groups.h cublas.h cublas_v2.h cublasLt.h cublas_api.h cudnn.h
    curand_kernel.h nvtx3.h
    """.split()
)
_ALLOWED_HEADER_PREFIXES = (
    "torch/",
    "ATen/",
    "c10/",
    "pybind11/",
    "cooperative_groups/",
    "cub/",
    "thrust/",
    "cuda/",
    "nv/",
    "crt/",
    "nvtx3/",
    "sys/",
    "bits/",
)
_ALLOWED_HEADER_RES = (
    re.compile(r"cuda_\w+\.hp?p?"),
    re.compile(r"cudnn\w*\.h"),
    re.compile(r"cublas\w*\.h"),
    re.compile(r"curand_\w+\.h"),
    re.compile(r"sm_\d+_\w+\.hp?p?"),
    re.compile(r"\w*intrin\.h"),
)
_REGISTRY_HEADERS = ("binding_registry.h", "../binding_registry.h")


def _header_allowed(path: str) -> bool:
    if path in _STD_HEADERS or path in _CUDA_HEADERS:
        return True
    if path.startswith(_ALLOWED_HEADER_PREFIXES):
        return True
    return any(r.fullmatch(path) for r in _ALLOWED_HEADER_RES)


_CPP_ALLOWED_TOP = frozenset(
    """
    Tensor TensorBase TensorOptions TensorList TensorRef OptionalTensorRef ScalarType Scalar
    Device DeviceType DeviceGuard OptionalDeviceGuard Dtype Layout MemoryFormat IntArrayRef
    SymIntArrayRef OptionalIntArrayRef ArrayRef DimVector SmallVector optional nullopt
    make_optional Half BFloat16 Float8_e4m3fn Float8_e5m2 Float8_e4m3fnuz Float8_e5m2fnuz
    complex ComplexHalf ComplexFloat ComplexDouble Generator Storage DataPtr TensorAccessor
    PackedTensorAccessor PackedTensorAccessor32 PackedTensorAccessor64
    GenericPackedTensorAccessor RestrictPtrTraits DefaultPtrTraits acc_type opmath_type
    NoGradGuard InferenceMode AutoGradMode TensorArg TensorGeometryArg
    empty empty_like empty_strided zeros zeros_like ones ones_like full full_like from_blob
    tensor arange rand rand_like randn randn_like randint dtype device layout requires_grad
    memory_format pinned_memory scalarTypeToTypeMeta typeMetaToScalarType elementSize toString
    isFloatingType isIntegralType isComplexType isReducedFloatingType CppTypeToScalarType
    ScalarTypeToCPPType ScalarTypeToCPPTypeT maybe_wrap_dim ceil_div numeric_limits
    globalContext Context parallel_for parallel_reduce get_num_threads set_num_threads
    get_thread_num in_parallel_region init_num_threads internal indexing autograd stable List
    Dict IValue OrderedDict
    cat concat stack reshape flatten unflatten permute transpose t unsqueeze squeeze narrow
    select split chunk unbind clone detach movedim as_strided broadcast_to view_as_real
    view_as_complex
    """.split()
)
_CPP_CHECK_RE = re.compile(r"check\w*|k[A-Z]\w*")
_AT_CUDA_ALLOWED_RE = re.compile(
    r"get\w*|set\w*|CUDA\w*|Optional\w*|current_device|device_count|warp_size|"
    r"ATenCeilDiv|detail|is_available|device_synchronize|stream_synchronize"
)
_AT_NATIVE_ALLOWED = frozenset({"getCudnnHandle"})

_QUAL_RE = re.compile(r"(?<![\w:])(?:::\s*)?\b(torch|at|c10|caffe2)((?:\s*::\s*~?\w+)+)")
_MEMBER_RE = re.compile(
    r"(?<=[\w)\]])\s*(?:\.|->)\s*(?:template\s+)?([A-Za-z_]\w*)\s*(?:<[^;{}()<>]*>)?\s*\("
)
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]*)[>"]', re.M)
_THREAD_RES = (
    re.compile(r"\bstd\s*::\s*(thread|jthread|async)\b"),
    re.compile(r"\bstd\s*::\s*execution\s*::\s*par(?:_unseq)?\b"),
    re.compile(r"\b(pthread_create)\s*\("),
    re.compile(r"(?<![\w.>])(?:::\s*)?\b(v?fork)\s*\("),
    re.compile(r"\bat\s*::\s*(launch)\b"),
)
_TAMPER_RES = (
    (
        re.compile(r"\bTORCH_LIBRARY(?:_IMPL|_FRAGMENT)?\b"),
        "registers operators with the PyTorch dispatcher, which can change what the baseline "
        "runs; expose your functions through REGISTER_BINDING (or load_inline's functions=).",
    ),
    (
        re.compile(
            r"\b(?:py|pybind11)\s*::\s*(?:module_?\s*::\s*import|eval|exec|eval_file|globals)\b"
        ),
        "runs Python from C++; the extension must compute in C++/CUDA only.",
    ),
    (
        re.compile(r"\b(?:PyImport_\w+|PyRun_\w+|PyEval_EvalCode\w*)\b"),
        "runs Python from C++; the extension must compute in C++/CUDA only.",
    ),
    (
        re.compile(r"\b(?:dlopen|dlsym)\s*\("),
        "loads shared libraries at run time; use only the toolkit libraries linked by the build.",
    ),
    (
        re.compile(r"(?:\bstd\s*::\s*|(?<![\w.>:]))(?:system|popen|exec[lv]p?e?)\s*\("),
        "starts external programs; the extension must only compute.",
    ),
    (
        re.compile(r"\b(?:fopen|freopen)\s*\(|\bstd\s*::\s*[io]?fstream\b"),
        "does file I/O; kernels must take their data from their tensor arguments only.",
    ),
)
_LIBRARY_NAMESPACE_RE = re.compile(
    r"\b(cutlass|cute|Eigen|dnnl|mkldnn|ideep|oneapi|cudnn_frontend|xnnpack|tvm|flashinfer)\s*::"
)
_LIBRARY_CALL_RE = re.compile(
    r"\b((?:cblas|mkl|MKL|dnnl|LAPACKE|openblas)_\w+|(?:cufft|cusparse|cusolver|cutensor|"
    r"nccl|npp|curandCreate|curandGenerate)\w*)\s*\("
)
_TORCH_USE_RE = re.compile(r"\bTensor\b|\btorch\s*::|\bat\s*::")


def _classify_cpp_name(parts: list[str]) -> tuple[str, str] | None:
    root = parts[0]
    name = "::".join(parts)
    if root in ("c10", "caffe2") or len(parts) < 2:
        return None
    p1 = parts[1]
    compute = (
        RULE_TORCH_COMPUTE,
        f"`{name}` is a PyTorch compute op; write this computation in your own kernel "
        "(from ATen use only tensor allocation, metadata and stream/guard helpers).",
    )
    if root == "at" and p1 == "launch":
        return (
            RULE_THREADS,
            f"`{name}` runs work on ATen's thread pool; launch your kernels from the calling "
            "thread instead.",
        )
    if p1 == "cuda":
        if root == "torch" or len(parts) == 2 or _AT_CUDA_ALLOWED_RE.fullmatch(parts[2]):
            return None
        return compute
    if p1 == "native":
        if len(parts) > 2 and parts[2] in _AT_NATIVE_ALLOWED:
            return None
        return compute
    if p1 in _CPP_ALLOWED_TOP or _CPP_CHECK_RE.fullmatch(p1):
        return None
    return compute


def _check_cpp(
    source: str,
    *,
    filename: str,
    device: str,
    single_file: bool,
    known_files: Collection[str] | None,
) -> list[Violation]:
    _check_device(device)
    no_comments, code = _strip_cpp(source)
    starts = [0] + [m.end() for m in re.finditer("\n", source)]

    def line_of(offset: int) -> int:
        return bisect.bisect_right(starts, offset)

    out: list[Violation] = []

    def add(rule: str, offset: int, message: str) -> None:
        out.append(Violation(rule, filename, line_of(offset), message))

    libs = "cuBLAS and cuDNN" if device == "cuda" else "no BLAS/MKL/oneDNN (OpenMP is fine)"
    base_dir = posixpath.dirname(filename.split(":")[0])
    for m in _INCLUDE_RE.finditer(no_comments):
        quote, path = m.group(1), m.group(2).strip()
        ok = _header_allowed(path)
        if quote == '"' and not ok:
            if path in _REGISTRY_HEADERS or posixpath.basename(path) == "binding_registry.h":
                ok = True
            elif known_files is not None:
                resolved = posixpath.normpath(posixpath.join(base_dir, path))
                ok = resolved in known_files
            else:
                ok = not path.startswith("/") and ".." not in path.split("/")
        if not ok:
            add(
                RULE_LIBRARY,
                m.start(),
                f"`#include {quote}{path}{'>' if quote == '<' else quote}` is not a standard, "
                f"CUDA toolkit, torch or solution header; third-party libraries are not allowed "
                f"(allowed: {libs}).",
            )
        elif path.startswith(("cublas", "cudnn")) and device == "cpu":
            pass  # cannot build on the CPU flavour anyway; the compiler will say so
    uses_torch = single_file or bool(
        re.search(r"^\s*#\s*include\s*[<\"](?:torch|ATen|c10)/", no_comments, re.M)
        or _TORCH_USE_RE.search(code)
    )
    for m in _QUAL_RE.finditer(code):
        parts = [m.group(1)] + re.findall(r"~?\w+", m.group(2))
        verdict = _classify_cpp_name(parts)
        if verdict:
            add(verdict[0], m.start(), verdict[1])
    if uses_torch:
        for m in _MEMBER_RE.finditer(code):
            method = m.group(1)
            if method in CPP_COMPUTE_METHODS:
                add(
                    RULE_TORCH_COMPUTE,
                    m.start(1),
                    f"`.{method}(...)` calls the ATen tensor op {method}; compute it in your "
                    "own kernel instead.",
                )
    for rx in _THREAD_RES:
        for m in rx.finditer(code):
            add(
                RULE_THREADS,
                m.start(),
                f"`{' '.join(m.group(0).split()).rstrip('(').strip()}` starts threads or "
                "processes; use CUDA parallelism (or OpenMP on the CPU) instead.",
            )
    if not single_file and posixpath.basename(filename) != "binding.cpp":
        for m in re.finditer(r"\bPYBIND11_MODULE\b", code):
            add(
                RULE_INTROSPECTION,
                m.start(),
                "`PYBIND11_MODULE` is defined by the locked binding.cpp; register your "
                "functions with REGISTER_BINDING(name, fn) instead.",
            )
    for rx, why in _TAMPER_RES:
        for m in rx.finditer(code):
            shown = " ".join(m.group(0).split()).rstrip("(").strip()
            add(RULE_INTROSPECTION, m.start(), f"`{shown}` {why}")
    for m in _LIBRARY_NAMESPACE_RE.finditer(code):
        add(
            RULE_LIBRARY,
            m.start(),
            f"`{m.group(1)}::` is a third-party library; write the kernel yourself "
            f"(allowed: {libs}).",
        )
    for m in _LIBRARY_CALL_RE.finditer(code):
        add(
            RULE_LIBRARY,
            m.start(),
            f"`{m.group(1)}` calls a library other than cuBLAS/cuDNN; write the kernel "
            f"yourself (allowed: {libs}).",
        )
    for m in re.finditer(r"\bmodel\.py\b", no_comments):
        add(
            RULE_REFERENCE_FALLBACK,
            m.start(),
            "the source names model.py, the reference implementation; kernels must not read "
            "or load it.",
        )
    return _dedupe(out)


def check_cpp_source(
    source: str,
    *,
    filename: str,
    device: str,
    single_file: bool = False,
    known_files: Collection[str] | None = None,
) -> list[Violation]:
    """Check one C++/CUDA source.

    ``single_file`` marks load_inline sources (where the extension's own
    ``PYBIND11_MODULE`` is legitimate); ``known_files`` lists the solution's paths so that
    quoted includes can be resolved (None: accept any relative quoted include).
    """
    return _check_cpp(
        source,
        filename=filename,
        device=device,
        single_file=single_file,
        known_files=known_files,
    )


# ----------------------------------------------------------------------------------------
# Whole solutions
# ----------------------------------------------------------------------------------------


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")


def _dedupe(violations: Iterable[Violation]) -> list[Violation]:
    seen: set[tuple[str, str, int, str]] = set()
    out: list[Violation] = []
    for v in sorted(violations, key=lambda v: v.line):
        key = (v.rule, v.file, v.line, v.message)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def _inline_violations(source: str, *, filename: str, device: str) -> Iterator[Violation]:
    for inline in extract_inline_sources(source):
        label = f"{filename}:{inline.kind}"
        for v in _check_cpp(
            inline.text, filename=label, device=device, single_file=True, known_files=()
        ):
            yield Violation(v.rule, v.file, inline.python_line(v.line), v.message)


def check_solution(files: Mapping[str, str], *, device: str, single_file: bool) -> list[Violation]:
    """Check every file of a solution; paths are relative to the workspace root.

    ``model_new.py`` gets the Python rules; ``.cu``/``.cuh``/``.cpp``/``.cc``/``.h``/
    ``.hpp`` (and similar) files get the C++ rules; any other ``.py`` file is a
    ``forbidden-import`` violation; other files are ignored. In the single-file format the
    ``cpp_sources``/``cuda_sources`` given to ``load_inline`` are checked as C++ and
    reported as ``model_new.py:cuda_sources`` with the line in ``model_new.py``.
    """
    _check_device(device)
    normalised = {posixpath.normpath(p.replace("\\", "/")).lstrip("/"): t for p, t in files.items()}
    known = frozenset(normalised)
    out: list[Violation] = []
    if MODEL_NEW not in normalised:
        out.append(
            Violation(
                RULE_MISSING_MODELNEW,
                MODEL_NEW,
                0,
                "the solution has no model_new.py; write model_new.py defining class ModelNew.",
            )
        )
    for path in sorted(normalised, key=lambda p: (p != MODEL_NEW, p)):
        text = normalised[path]
        lower = path.lower()
        if lower.endswith(".py"):
            if path == MODEL_NEW:
                out += check_model_new(text, filename=path, single_file=single_file)
                if single_file:
                    out += _dedupe(_inline_violations(text, filename=path, device=device))
            else:
                out.append(
                    Violation(
                        RULE_FORBIDDEN_IMPORT,
                        path,
                        0,
                        f"{path} is an extra Python file; the only Python a solution may "
                        f"contain is {MODEL_NEW}, so move the code there.",
                    )
                )
        elif lower.endswith(CPP_SUFFIXES):
            out += _check_cpp(
                text,
                filename=path,
                device=device,
                single_file=single_file,
                known_files=known,
            )
    return out
