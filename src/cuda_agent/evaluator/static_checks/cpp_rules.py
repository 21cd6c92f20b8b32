"""The C++ rules, for kernel files and ``load_inline`` sources alike.

Comments and string literals are blanked first (line numbers kept), then includes are
matched against the header allowlist and the code is scanned for ATen compute ops, threads,
third-party libraries, dispatcher registration and other tampering.
"""

from __future__ import annotations

import bisect
import posixpath
import re
from collections.abc import Collection

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.static_checks.violation import Violation, dedupe
from cuda_agent.evaluator.static_checks.vocabulary import ADL_COMPUTE, CPP_COMPUTE_METHODS

DEVICES = ("cuda", "cpu")


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")


# -- stripping: comments and literals blanked, offsets and line numbers kept ----------------


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


def strip_cpp(src: str) -> tuple[str, str]:
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


# -- the header allowlist (CUB and Thrust ship inside the toolkit, header-only) ------------

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
_ALLOWED_HEADER_RE = re.compile(  # matched whole: one of these forms
    r"cuda_\w+\.hp?p?|cudnn\w*\.h|cublas\w*\.h|curand_\w+\.h|sm_\d+_\w+\.hp?p?|\w*intrin\.h"
)
_REGISTRY_HEADERS = ("binding_registry.h", "../binding_registry.h")


def _header_allowed(path: str) -> bool:
    if path in _STD_HEADERS or path in _CUDA_HEADERS:
        return True
    if path.startswith(_ALLOWED_HEADER_PREFIXES):
        return True
    return _ALLOWED_HEADER_RE.fullmatch(path) is not None


# -- the rules: torch::/at:: names that may be used, and what betrays the others ----------

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
        re.compile(r"\b(?:enableRecordFunction|RecordFunctionGuard|DisableRecordFunctionGuard|removeCallback|"
                   r"clearCallbacks|clearGlobalCallbacks|clearThreadLocalCallbacks|addGlobalCallback|"
                   r"addThreadLocalCallback)\b"),
        "switches PyTorch's operator observers, which the evaluator's watch relies on; leave them alone.",
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
# `using namespace std;` (or `using std::thread;`) then a bare thread: the same as std::thread
_USING_STD_RE = re.compile(r"\busing\s+(?:namespace\s+std\b|std\s*::\s*(?:thread|jthread|async)\b)")
_BARE_THREAD_RE = re.compile(r"(?<![\w.:>])(thread|jthread)\s*(?:\w+\s*)?[({]|(?<![\w.:>])(async)\s*\(")
_BARE_CALL_RE = re.compile(r"(?<![\w.:>~])([A-Za-z_]\w*)\s*(?:<[^;{}()<>]*>)?\s*\(")
# a declaration or definition of a function: a type (word, pointer, reference, template
# close) before the name, not a keyword that precedes a call
_DECL_RE = re.compile(r"([\w>*&])\s+[*&]*\s*([A-Za-z_]\w*)\s*\(")
_CALL_KEYWORDS = frozenset("return else case new delete throw co_return co_yield sizeof typeid do".split())


def declared_functions(code: str) -> set[str]:
    """Names a C++ source (comments and literals blanked) declares or defines as functions."""
    out = set()
    for m in _DECL_RE.finditer(code):
        before = code[: m.start(1) + 1]
        word = re.search(r"\w+$", before)
        if word is None or word.group(0) not in _CALL_KEYWORDS:
            out.add(m.group(2))
    return out


def _classify_cpp_name(parts: list[str]) -> tuple[str, str] | None:
    root = parts[0]
    name = "::".join(parts)
    if root in ("c10", "caffe2") or len(parts) < 2:
        return None
    p1 = parts[1]
    compute = (
        rules.TORCH_COMPUTE,
        f"`{name}` is a PyTorch compute op; write this computation in your own kernel "
        "(from ATen use only tensor allocation, metadata and stream/guard helpers).",
    )
    if root == "at" and p1 == "launch":
        return (
            rules.THREADS,
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




def check_cpp_source(
    source: str,
    *,
    filename: str,
    device: str,
    single_file: bool = False,
    known_files: Collection[str] | None = None,
    declared: Collection[str] = (),
) -> list[Violation]:
    """Check one C++/CUDA source.

    ``single_file`` marks load_inline sources (where the extension's own
    ``PYBIND11_MODULE`` is legitimate); ``known_files`` lists the solution's paths so that
    quoted includes can be resolved (None: accept any relative quoted include);
    ``declared`` names functions the solution's other sources declare (an unqualified call
    of one of them is the solution's own function, not an ATen op found by lookup).
    """
    check_device(device)
    no_comments, code = strip_cpp(source)
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
                rules.LIBRARY,
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
                    rules.TORCH_COMPUTE,
                    m.start(1),
                    f"`.{method}(...)` calls the ATen tensor op {method}; compute it in your "
                    "own kernel instead.",
                )
    if uses_torch:
        own = set(declared) | declared_functions(code)
        for m in _BARE_CALL_RE.finditer(code):
            name = m.group(1)
            if name in ADL_COMPUTE and name not in own:
                add(
                    rules.TORCH_COMPUTE,
                    m.start(1),
                    f"`{name}(...)` unqualified: on tensors, argument-dependent lookup makes it the "
                    f"ATen op at::{name}; compute it in your own kernel (or name your own function "
                    "differently).",
                )
    if _USING_STD_RE.search(code):
        for m in _BARE_THREAD_RE.finditer(code):
            name = m.group(1) or m.group(2)
            add(
                rules.THREADS,
                m.start(),
                f"`{name}` with `using namespace std` is std::{name}: it starts threads; use CUDA "
                "parallelism (or OpenMP on the CPU) instead.",
            )
    for rx in _THREAD_RES:
        for m in rx.finditer(code):
            add(
                rules.THREADS,
                m.start(),
                f"`{' '.join(m.group(0).split()).rstrip('(').strip()}` starts threads or "
                "processes; use CUDA parallelism (or OpenMP on the CPU) instead.",
            )
    if not single_file and posixpath.basename(filename) != "binding.cpp":
        for m in re.finditer(r"\bPYBIND11_MODULE\b", code):
            add(
                rules.INTROSPECTION,
                m.start(),
                "`PYBIND11_MODULE` is defined by the locked binding.cpp; register your "
                "functions with REGISTER_BINDING(name, fn) instead.",
            )
    for rx, why in _TAMPER_RES:
        for m in rx.finditer(code):
            shown = " ".join(m.group(0).split()).rstrip("(").strip()
            add(rules.INTROSPECTION, m.start(), f"`{shown}` {why}")
    for m in _LIBRARY_NAMESPACE_RE.finditer(code):
        add(
            rules.LIBRARY,
            m.start(),
            f"`{m.group(1)}::` is a third-party library; write the kernel yourself "
            f"(allowed: {libs}).",
        )
    for m in _LIBRARY_CALL_RE.finditer(code):
        add(
            rules.LIBRARY,
            m.start(),
            f"`{m.group(1)}` calls a library other than cuBLAS/cuDNN; write the kernel "
            f"yourself (allowed: {libs}).",
        )
    for m in re.finditer(r"\bmodel\.py\b", no_comments):
        add(
            rules.REFERENCE_FALLBACK,
            m.start(),
            "the source names model.py, the reference implementation; kernels must not read "
            "or load it.",
        )
    return dedupe(out)

