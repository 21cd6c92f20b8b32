"""The names the static checks judge by.

Which torch and ATen ops compute (shared by the Python and C++ checks), and, for
``model_new.py``, which modules, torch names, builtins, dunders and methods are allowed
or tell a tensor from a plain value. Only data lives here; the rules that use it are in
``python_names``, ``python_analysis``, ``python_rules`` and ``cpp_rules``.
"""

from __future__ import annotations

import re

MODEL_NEW = "model_new.py"
EXTENSION_MODULE = "cuda_extension"

# Tensor ops that compute: torch functions, tensor methods and ATen members alike.
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

# ATen ops that an unqualified call on tensors finds through argument-dependent lookup
# (`mm(a, b)` is `at::mm`), unless the solution declares a function of that name itself.
# Plain math names (exp, max, tanh...) are left out: kernels call their own and the C ones.
ADL_COMPUTE: frozenset[str] = frozenset("""
mm bmm matmul addmm addbmm baddbmm addmv addr mv dot vdot outer inner einsum kron tensordot
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution linear
bilinear layer_norm batch_norm group_norm instance_norm softmax log_softmax logsumexp cumsum
cumprod cummax cummin argsort topk kthvalue argmax argmin index_select index_add gather
scatter scatter_add scatter_reduce masked_fill masked_select masked_scatter nonzero embedding
relu gelu silu hardtanh leaky_relu elu selu mish softplus sigmoid clamp clamp_min clamp_max
where sum mean prod amax amin var std norm cross_entropy mse_loss nll_loss binary_cross_entropy
""".split())

_DUNDER_RE = re.compile(r"^__\w+__$")


def is_dunder(name: str) -> bool:
    return bool(_DUNDER_RE.match(name))


# Python: what may be imported and which torch names are not compute.

ALLOWED_MODULES = frozenset(
    """
    math typing typing_extensions functools dataclasses __future__ collections enum abc
    numbers itertools
    """.split()
)
THREAD_MODULES = frozenset({"threading", "_thread", "multiprocessing", "concurrent", "asyncio"})

# torch.<name> that create tensors, describe them, or move/view data without arithmetic.
TORCH_FACTORIES = frozenset(
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
TORCH_ALLOWED_TOP = TORCH_FACTORIES | _TORCH_DTYPES | _TORCH_OTHER_ALLOWED
TORCH_TAMPER = frozenset(
    {"ops", "library", "overrides", "fx", "export", "package", "hub", "classes", "func", "masked"}
)
TORCH_AUTOGRAD_ALLOWED = frozenset(
    """
    Function function grad_mode no_grad enable_grad set_grad_enabled inference_mode
    Variable once_differentiable
    """.split()
)
TORCH_CUDA_FORBIDDEN = frozenset({"jiterator", "comm", "nccl"})
NN_NOT_LAYERS = frozenset(
    """
    Parameter ParameterList ParameterDict ModuleList ModuleDict Module Identity Buffer
    UninitializedParameter UninitializedBuffer
    """.split()
)
NN_ALLOWED_SUBMODULES = frozenset({"init", "parameter", "modules", "utils"})
ALLOWED_ATTR_DUNDERS = frozenset(
    {"__init__", "__name__", "__qualname__", "__doc__", "__version__"}
)
ALLOWED_NAME_DUNDERS = frozenset({"__name__", "__file__", "__doc__"})
ALLOWED_DEF_DUNDERS = frozenset({"__init__", "__repr__", "__str__", "__post_init__"})
DANGEROUS_BUILTINS = frozenset(
    """
    exec eval compile __import__ globals locals vars setattr delattr open input
    breakpoint getattr
    """.split()
)
REFERENCE_NAMES = frozenset({"Model", "get_inputs", "get_init_inputs"})
TENSOR_BUILTINS = frozenset({"abs", "sum", "max", "min", "pow", "round", "divmod"})
# Methods whose result is a tensor when the receiver is one (views, casts, copies).
TENSOR_PRESERVING_METHODS = frozenset(
    """
    view view_as reshape reshape_as contiguous permute transpose t unsqueeze squeeze flatten
    unflatten expand expand_as narrow select detach clone to cuda cpu float half double
    bfloat16 int long short bool byte char type_as new_empty new_zeros new_ones new_full
    new_tensor movedim swapaxes swapdims repeat repeat_interleave as_strided split chunk
    unbind tensor_split pin_memory requires_grad_ fill_ zero_ copy_ uniform_ normal_ flip
    roll diagonal mT
    """.split()
)
TENSOR_ATTRS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag", "grad"})
NON_TENSOR_CALLS = frozenset(
    """
    list dict set tuple sorted len range int float str bool enumerate zip reversed map
    filter frozenset
    """.split()
)
NON_TENSOR_METHODS = frozenset(
    {"size", "tolist", "item", "numel", "dim", "stride", "element_size", "data_ptr", "nelement"}
)
NON_TENSOR_ANNOTATIONS = frozenset(
    {"int", "float", "bool", "str", "list", "tuple", "dict", "bytes", "complex", "None"}
)
OS_ALLOWED = ("os.environ", "os.getenv", "os.path", "os.sep", "os.pathsep", "os.linesep")
OS_THREADS = ("os.fork", "os.forkpty", "os.spawn", "os.posix_spawn", "os.register_at_fork")
LOAD_INLINE = "torch.utils.cpp_extension.load_inline"

# What load_inline may link with -l: the toolkit, cuBLAS, cuDNN, torch, libc and OpenMP.
ALLOWED_LINK_LIBS = frozenset(
    """
    cublas cublasLt cudnn cudart cudart_static cuda c10 c10_cuda torch torch_cpu
    torch_cuda torch_python stdc++ m gomp omp iomp5 pthread dl rt
    """.split()
)

