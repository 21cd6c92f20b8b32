"""Compile a solution into one Python extension module, incrementally and cached.

Why not `torch.utils.cpp_extension.load`: it imports the module into the building
process, renames it (`cuda_extension_v1`) whenever sources change in a kept build
directory, and returns four hundred lines of ninja output on failure. Here we write the
ninja file ourselves:

- one kept build directory per solution (keyed by where the solution lives), whose
  sources are synced file by file, so editing one kernel recompiles only that file;
- a content-hash cache of finished modules, so an unchanged solution never rebuilds;
- a precompiled torch header for C++ files that include torch (a 24 s compile on a
  2-core machine becomes ~7 s);
- ninja runs inside the sandbox with only the build directory writable;
- compiler output comes back trimmed to the first errors with file:line.
"""

from __future__ import annotations

import fcntl
import glob
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from cuda_agent import sandbox
from cuda_agent.evaluator.compiler_output import trim_compiler_output
from cuda_agent.evaluator.solution import COMPILED_SUFFIXES, Solution
from cuda_agent.files import atomic_copy, atomic_write
from cuda_agent.paths import TEMPLATES, cache_dir, short_hash

BUILD_PROTOCOL = "3"  # 2: the fastest linker the compiler driver can use; 3: probed on a C++ link, GNU ld behind it
MODULE_NAME = "cuda_extension"
LOCKED_SOURCES = ("binding.cpp", "binding_registry.h")

# Flags a candidate may pass through load_inline(extra_*flags=...). Anything else (plugins,
# linker scripts, other libraries) is dropped and said so in the build log.
_ALLOWED_FLAG = re.compile(
    r"^(-O[0-3s]?|-std=c\+\+\d\d|--?use_fast_math|-ffast-math|-funroll-loops|-fopenmp"
    r"|-march=native|-mtune=native|-lineinfo|-D[A-Za-z_][A-Za-z0-9_]*(=[\w.]*)?"
    r"|--expt-relaxed-constexpr|--expt-extended-lambda|-Xptxas=?[-\w,=]*|-maxrregcount=?\d*"
    r"|--ptxas-options=[-\w,=]+|-lcublas|-lcublasLt|-lcudnn|-w|-Wall|-Wno-[\w-]+)$"
)


@dataclass
class ExtensionSpec:
    """What to compile into one module."""

    name: str
    sources: dict[str, str]  # relative path -> text; headers included
    with_cuda: bool
    extra_cflags: list[str] = field(default_factory=list)
    extra_cuda_cflags: list[str] = field(default_factory=list)
    extra_ldflags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cuda_requested: bool = False  # load_inline asked for CUDA (on the cpu device it cannot be had)

    @property
    def compiled(self) -> list[str]:
        return sorted(p for p in self.sources if p.endswith(COMPILED_SUFFIXES))


@dataclass
class BuildOptions:
    device: str = "cpu"  # "cuda" | "cpu"
    timeout_s: float = 600.0
    jobs: int | None = None
    arch: str | None = None  # "9.0"; default: the assigned GPU's, or TORCH_CUDA_ARCH_LIST
    gpu_index: int = 0
    use_pch: bool = True
    sandbox: sandbox.SandboxConfig = field(default_factory=sandbox.SandboxConfig)


@dataclass
class BuildResult:
    ok: bool
    module_name: str
    so_path: Path | None
    message: str
    log: str
    duration_s: float
    cached: bool = False
    timed_out: bool = False
    build_dir: Path | None = None
    rebuilt: list[str] = field(default_factory=list)


def workspace_extension(solution: Solution, device: str) -> ExtensionSpec:
    """The workspace format: pristine binding.cpp/binding_registry.h + kernels/*."""
    sources = {name: (TEMPLATES / name).read_text() for name in LOCKED_SOURCES}
    sources.update(solution.kernel_files)
    spec = ExtensionSpec(name=MODULE_NAME, sources=sources, with_cuda=device == "cuda")
    return spec


def sanitize_flags(flags: Sequence[str] | str | None, notes: list[str]) -> list[str]:
    if flags is None:
        return []
    if isinstance(flags, str):
        flags = shlex.split(flags)
    kept = []
    for f in flags:
        f = str(f).strip()
        if not f:
            continue
        if _ALLOWED_FLAG.match(f):
            kept.append(f)
        else:
            notes.append(f"ignored compiler/linker flag {f!r} (not allowed)")
    return kept


def inline_extension(call: Mapping[str, object], device: str) -> ExtensionSpec:
    """The sources `torch.utils.cpp_extension.load_inline` would have written."""
    notes: list[str] = []

    def as_list(v: object) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return [str(x) for x in v]  # type: ignore[union-attr]

    name = str(call.get("name") or "inline_ext")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        notes.append(f"extension name {name!r} replaced by 'inline_ext'")
        name = "inline_ext"
    cpp = "#include <torch/extension.h>\n" + "\n".join(as_list(call.get("cpp_sources")))
    functions = call.get("functions")
    if functions:
        items = functions.items() if isinstance(functions, dict) else ((f, f) for f in as_list(functions))
        defs = "\n".join(
            f'  m.def("{fn}", torch::wrap_pybind_function({fn}), "{fn}");' for fn, _ in items
        )
        cpp += f"\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}\n}}\n"
    sources = {"main.cpp": cpp}
    cuda = as_list(call.get("cuda_sources"))
    with_cuda = bool(cuda) or bool(call.get("with_cuda"))
    if cuda:
        sources["cuda.cu"] = (
            "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + "\n".join(cuda)
        )
    return ExtensionSpec(
        name=name,
        sources=sources,
        with_cuda=with_cuda and device == "cuda",
        extra_cflags=sanitize_flags(call.get("extra_cflags"), notes),  # type: ignore[arg-type]
        extra_cuda_cflags=sanitize_flags(call.get("extra_cuda_cflags"), notes),  # type: ignore[arg-type]
        extra_ldflags=sanitize_flags(call.get("extra_ldflags"), notes),  # type: ignore[arg-type]
        notes=notes,
        cuda_requested=with_cuda,
    )


# ---------------------------------------------------------------------------------------
# Toolchain


@dataclass(frozen=True)
class Toolchain:
    cxx: str
    nvcc: str | None
    ninja: str
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    cuda_ldflags: tuple[str, ...]
    fingerprint: str
    torch_lib: str


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.strip().splitlines()[-1] if out.strip() else "?"


def _find_ninja() -> str:
    try:
        import ninja  # type: ignore[import-untyped]

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise RuntimeError("ninja is not installed: pip install ninja")
    return found


def cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME/$CUDA_PATH, else the folder above the `nvcc` on PATH
    (a wrapper script such as `exec /opt/cuda-13.0/bin/nvcc "$@"` is followed), else the usual
    install folders. A root counts only if it has bin/nvcc and include/cuda_runtime.h."""

    def is_root(d: str | Path | None) -> bool:
        return bool(d) and Path(d, "bin", "nvcc").exists() and Path(d, "include", "cuda_runtime.h").exists()

    cands: list[str | Path | None] = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        cands.append(real.parent.parent)
        try:
            if real.stat().st_size < 4096:  # a shell wrapper: look for the real nvcc it runs
                for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc\b", real.read_text(errors="replace")):
                    cands.append(m.group(1))
        except OSError:
            pass
    cands += ["/usr/local/cuda", "/opt/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for cand in cands:
        if is_root(cand):
            return str(cand)
    return None


def _nvidia_pkg_dir(name: str) -> Path | None:
    try:
        import importlib

        mod = importlib.import_module(f"nvidia.{name}")
    except ImportError:
        return None
    paths = list(getattr(mod, "__path__", []))
    return Path(paths[0]) if paths else None


def _find_lib(libname: str, dirs: Sequence[Path]) -> Path | None:
    for d in dirs:
        if not d.is_dir():
            continue
        exact = d / f"lib{libname}.so"
        if exact.exists():
            return exact
        versioned = sorted(d.glob(f"lib{libname}.so.*"))
        if versioned:
            return versioned[0]
    return None


@cache
def detect_arch(gpu_index: int = 0) -> str:
    """Compute capability of the GPU, e.g. '9.0', without creating a CUDA context here."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env.split(";")[0].split()[0].replace("+PTX", "")
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", "-i", str(gpu_index)],
            capture_output=True, text=True, timeout=30,
        )
        cap = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
        if re.fullmatch(r"\d+\.\d+", cap):
            return cap
    except (OSError, subprocess.TimeoutExpired, IndexError):
        pass
    code = f"import torch; c = torch.cuda.get_device_capability({gpu_index}); print(f'{{c[0]}}.{{c[1]}}')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    cap = out.stdout.strip()
    if out.returncode != 0 or not re.fullmatch(r"\d+\.\d+", cap):
        raise RuntimeError("could not detect the GPU architecture; pass --arch (e.g. 9.0)")
    return cap


def _std_flag() -> str:
    import torch.utils.cpp_extension as ce

    text = Path(ce.__file__).read_text()
    return "-std=c++20" if "-std=c++20" in text else "-std=c++17"


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = re.search(r"flags\s*:\s*(.*)", info)
    return short_hash((model.group(1) if model else "") + (flags.group(1) if flags else ""))


def _toolchain_key(device: str, arch: str | None) -> str:
    """What the toolchain depends on, readable without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    torch_dir = Path(spec.origin).parent if spec and spec.origin else Path("?")
    stamps = []
    for f in (torch_dir / "version.py", torch_dir / "lib" / "libtorch_cpu.so"):
        try:
            st = f.stat()
            stamps.append(f"{f}:{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            stamps.append(f"{f}:missing")
    tools = [os.environ.get("CXX") or shutil.which("c++") or "", shutil.which("nvcc") or "",
             os.environ.get("CUDA_HOME", ""), os.environ.get("TORCH_CUDA_ARCH_LIST", "")]
    for t in tools[:2]:
        if t:
            try:
                tools.append(str(Path(t).resolve().stat().st_mtime_ns))
            except OSError:
                pass
    cpu = _cpu_signature() if device != "cuda" else ""  # -march=native builds are per CPU
    return short_hash(BUILD_PROTOCOL, sys.executable, device, arch or "", cpu, *stamps, *tools)


@cache
def toolchain(device: str, arch: str | None = None) -> Toolchain:
    """The compiler set-up, cached on disk: working it out imports torch (seconds)."""
    import json

    if device == "cuda" and arch is None:
        arch = detect_arch()  # nvidia-smi: fast, and no CUDA context in this process
    path = cache_dir("toolchains") / f"{_toolchain_key(device, arch)}.json"
    try:
        data = json.loads(path.read_text())
        return Toolchain(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except (OSError, ValueError, TypeError):
        pass
    tc = _make_toolchain(device, arch)
    atomic_write(path, json.dumps(vars(tc)))
    return tc


def _make_toolchain(device: str, arch: str | None) -> Toolchain:
    import torch
    import torch.utils.cpp_extension as ce

    with_cuda = device == "cuda"
    torch_lib = str(Path(torch.__file__).parent / "lib")
    # torch's own CUDA include paths need torch to find CUDA_HOME; ours are added below.
    includes = list(ce.include_paths("cpu"))
    py_inc = sysconfig.get_path("include", scheme="posix_prefix")
    if py_inc:
        includes.append(py_inc)
    defines = [
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    abi_flags = getattr(ce, "_get_pybind11_abi_build_flags", None)
    if abi_flags is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defines += list(abi_flags())
    std = _std_flag()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    inc_flags = [f for p in includes for f in ("-isystem", p)]
    cflags = [*defines, *inc_flags, "-fPIC", std, "-O3", "-fopenmp"]
    ldflags = ["-shared", "-fopenmp", f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python",
               f"-Wl,-rpath,{torch_lib}"]
    cuda_cflags: list[str] = []
    cuda_ldflags: list[str] = []
    nvcc = None
    if with_cuda:
        home = cuda_home()
        if home is None:
            raise RuntimeError("CUDA toolkit (nvcc) not found; set CUDA_HOME")
        nvcc = str(Path(home) / "bin" / "nvcc")
        arch = arch or detect_arch()
        major, minor = arch.split(".")
        lib_dirs = [Path(home) / "lib64", Path(home) / "lib"]
        extra_inc = [str(Path(home) / "include")]
        if os.environ.get("CUDA_INC_PATH"):
            extra_inc.append(os.environ["CUDA_INC_PATH"])
        if os.environ.get("CUDNN_HOME"):
            extra_inc.append(str(Path(os.environ["CUDNN_HOME"]) / "include"))
        for pkg in ("cublas", "cudnn", "cuda_runtime"):
            d = _nvidia_pkg_dir(pkg)
            if d is not None:
                lib_dirs.append(d / "lib")
                if (d / "include").is_dir():
                    extra_inc.append(str(d / "include"))
        inc_flags += [f for p in extra_inc if p != "/usr/include" for f in ("-isystem", p)]
        cflags = [*defines, *inc_flags, "-fPIC", std, "-O3", "-fopenmp"]
        cuda_cflags = [
            *defines, *inc_flags, *ce.COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", std,
            "-O3", "--use_fast_math", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
        ]
        cuda_ldflags = ["-lc10_cuda", "-ltorch_cuda"]
        for lib in ("cudart", "cublas", "cublasLt", "cudnn"):
            found = _find_lib(lib, lib_dirs)
            if found is not None:
                cuda_ldflags += [f"-L{found.parent}", f"-l:{found.name}", f"-Wl,-rpath,{found.parent}"]
    else:
        cflags.append("-march=native")
    ninja = _find_ninja()
    # probed on the link an extension makes, where builds run
    ldflags[2:2] = _fast_linker(cxx, [*ldflags, *cuda_ldflags], _path_env(ninja, nvcc))
    fingerprint = short_hash(
        BUILD_PROTOCOL, torch.__version__, str(torch.version.git_version), sys.version,
        _version([cxx, "--version"]), _version([nvcc, "--version"]) if nvcc else "",
        " ".join(cflags), " ".join(cuda_cflags), " ".join(ldflags + cuda_ldflags),
        platform.machine(), _cpu_signature() if not with_cuda else "",
    )
    return Toolchain(
        cxx=cxx, nvcc=nvcc, ninja=ninja, cflags=tuple(cflags), cuda_cflags=tuple(cuda_cflags),
        ldflags=tuple(ldflags), cuda_ldflags=tuple(cuda_ldflags), fingerprint=fingerprint,
        torch_lib=torch_lib,
    )


FAST_LINKERS = ("mold", "lld", "gold")  # tried in this order; GNU ld is the default


def _fast_linker(cxx: str, link_args: Sequence[str] = (), path: str | None = None,
                 readonly: Sequence[Path] = ()) -> list[str]:
    """`-fuse-ld=` for the fastest linker `cxx` can drive here (mold, lld, gold), or nothing
    (GNU ld). Linking is most of a one-kernel-file rebuild: the linker reads the symbols of
    torch's libraries (about 0.9 GB with CUDA), which took GNU ld 0.21-0.23 s and gold
    0.10-0.11 s on the CPU build machine, for both the CPU and the CUDA extension.

    The probe links as a build does: a C++ shared object (the C++ driver adds libstdc++)
    with `link_args` (OpenMP, torch's and CUDA's libraries), in the sandbox where there is
    one, with the builds' PATH. A linker that links C can still fail there: on the GPU
    machine, whose g++ 13 lives under /opt with links into /usr, every build failed with
    gold's "cannot open .../libstdc++.so", where GNU ld skips such a file and searches on."""
    ok, _ = sandbox.sandbox_available()
    cfg = sandbox.SandboxConfig(enabled=ok, timeout_s=60.0, address_space_mb=None, gpu_index=None)
    env = {"PATH": path or os.environ.get("PATH", ""), "TMPDIR": "/tmp"}
    # (`readonly`: folders the link reads beyond the system's and Python's, which the sandbox shows)
    with tempfile.TemporaryDirectory(prefix="cuda-agent-ld-", dir=cache_dir("runs")) as d:
        src, out = Path(d, "probe.cpp"), Path(d, "probe.so")
        src.write_text("#include <string>\nstd::string cuda_agent_probe() { return std::string(3, 'x'); }\n")
        for name in FAST_LINKERS:
            argv = [cxx, "-shared", "-fPIC", str(src), *link_args, f"-fuse-ld={name}", "-o", str(out)]
            try:
                r = sandbox.run(argv, cwd=Path(d), writable=[Path(d)], readonly=list(readonly), env=env, config=cfg)
            except (OSError, ValueError, sandbox.SandboxUnavailable):
                return []
            if r.returncode == 0 and not r.timed_out and out.exists():
                return [f"-fuse-ld={name}"]
    return []


# ---------------------------------------------------------------------------------------
# Precompiled headers

PCH_HEADERS = {
    "types": "#pragma once\n#include <torch/types.h>\n#include <torch/csrc/utils/pybind.h>\n",
    "extension": "#pragma once\n#include <torch/extension.h>\n",
}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pch_kind(source: str) -> str | None:
    if "torch/extension.h" in source:
        return "extension"
    if re.search(r"#\s*include\s*[<\"](torch|ATen|c10)/", source):
        return "types"
    return None


def pch_built(tc: Toolchain, kind: str) -> bool:
    """Whether ensure_pch would answer at once (built, or known not to build)."""
    d = cache_dir("pch", tc.fingerprint, kind)
    return (d / "ca_prelude.h.gch").exists() or (d / "FAILED").exists()


def ensure_pch(tc: Toolchain, kind: str, timeout_s: float = 900.0) -> Path | None:
    """Build (once per toolchain) a precompiled torch header; None if it cannot be built."""
    d = cache_dir("pch", tc.fingerprint, kind)
    header = d / "ca_prelude.h"
    gch = d / "ca_prelude.h.gch"
    failed = d / "FAILED"
    if gch.exists():
        return header
    if failed.exists():
        return None
    with _locked(d / ".lock"):
        if gch.exists():
            return header
        header.write_text(PCH_HEADERS[kind])
        tmp = d / f"ca_prelude.h.gch.tmp{os.getpid()}"
        cmd = [tc.cxx, "-x", "c++-header", str(header), "-o", str(tmp), *tc.cflags]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0 or not tmp.exists():
            failed.write_text(proc.stderr[-4000:])
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, gch)
    return header


# ---------------------------------------------------------------------------------------
# Ninja


def _object_name(rel: str) -> str:
    stem = rel.replace("/", "__")
    return stem + (".cuda.o" if rel.endswith(".cu") else ".o")


def _ninja_file(spec: ExtensionSpec, tc: Toolchain, pch: Mapping[str, Path]) -> str:
    """Sources are named relative to the obj/ directory ninja runs in, so a build directory
    copied elsewhere stays valid (ninja sees the same commands and keeps its objects)."""
    q = shlex.quote
    cflags = [*tc.cflags, f"-DTORCH_EXTENSION_NAME={spec.name}", "-I../src", *spec.extra_cflags]
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {q(tc.cxx)}",
        f"cflags = {' '.join(q(f) for f in cflags)}",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags $pchflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = $in",
    ]
    ldflags = [*tc.ldflags, *(tc.cuda_ldflags if spec.with_cuda else ()), *spec.extra_ldflags]
    if spec.with_cuda:
        assert tc.nvcc is not None
        cuda = [*tc.cuda_cflags, f"-DTORCH_EXTENSION_NAME={spec.name}", "-I../src", *spec.extra_cuda_cflags]
        lines += [
            f"nvcc = {q(tc.nvcc)}",
            f"cuda_cflags = {' '.join(q(f) for f in cuda)}",
            "rule cuda_compile",
            "  command = $nvcc --generate-dependencies-with-compile --dependency-output $out.d $cuda_cflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = $in",
        ]
    lines.append(f"ldflags = {' '.join(q(f) for f in ldflags)}")
    default_ld = [f for f in ldflags if not f.startswith("-fuse-ld=")]
    if default_ld != ldflags:
        # A faster linker that fails where GNU ld would not (a library the probe did not
        # link, found through a dangling link) costs a second link, not the build.
        lines += [f"ldflags_default = {' '.join(q(f) for f in default_ld)}", "rule link",
                  "  command = $cxx $in $ldflags -o $out 2>/dev/null || $cxx $in $ldflags_default -o $out"]
    else:
        lines += ["rule link", "  command = $cxx $in $ldflags -o $out"]
    lines.append("  description = link $out")
    objects = []
    for rel in spec.compiled:
        obj = _object_name(rel)
        objects.append(obj)
        src = f"../src/{rel}"
        if rel.endswith(".cu"):
            lines.append(f"build {obj}: cuda_compile {q(src)}")
        else:
            lines.append(f"build {obj}: compile {q(src)}")
            kind = pch_kind(spec.sources[rel])
            if kind and kind in pch:
                lines.append(f"  pchflags = -include {q(str(pch[kind]))}")
    so = f"{spec.name}.so"
    lines.append(f"build {so}: link {' '.join(objects)}")
    lines.append(f"default {so}")
    return "\n".join(lines) + "\n"


def _sync_sources(spec: ExtensionSpec, src_dir: Path) -> list[str]:
    """Make src_dir hold exactly spec.sources; rewrite only changed files (keeps ninja incremental)."""
    changed = []
    wanted = {src_dir / rel: text for rel, text in spec.sources.items()}
    if src_dir.exists():
        for f in sorted(src_dir.rglob("*"), reverse=True):
            if f.is_file() or f.is_symlink():
                if f not in wanted:
                    f.unlink()
            elif f.is_dir() and not any(f.iterdir()):
                f.rmdir()
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        if path.exists() and path.read_text(errors="replace") == text:
            continue
        path.write_text(text)
        changed.append(str(path.relative_to(src_dir)))
    return changed


def spec_hash(spec: ExtensionSpec, tc: Toolchain) -> str:
    parts: list[str] = [tc.fingerprint, spec.name, str(spec.with_cuda), *spec.extra_cflags, "|",
                        *spec.extra_cuda_cflags, "|", *spec.extra_ldflags]
    for rel in sorted(spec.sources):
        parts += [rel, spec.sources[rel]]
    return short_hash(*parts, n=24)


def build_extension(spec: ExtensionSpec, options: BuildOptions, build_key: str) -> BuildResult:
    """Compile `spec` into `<name>.so`; never raises for anything the sources do."""
    t0 = time.perf_counter()
    if options.device != "cuda" and (spec.cuda_requested or any(rel.endswith(".cu") for rel in spec.sources)):
        cu = [rel for rel in spec.sources if rel.endswith(".cu")] or ["cuda_sources"]
        return BuildResult(
            ok=False, module_name=spec.name, so_path=None, duration_s=time.perf_counter() - t0, log="",
            message=(f"{', '.join(cu)}: CUDA sources cannot be built for the cpu device; "
                     "write C++ kernels in kernels/*.cpp (OpenMP allowed)."),
        )
    if not spec.compiled:
        return BuildResult(ok=False, module_name=spec.name, so_path=None, duration_s=0.0, log="",
                           message="no source files to compile (kernels/ is empty).")
    arch = options.arch or (detect_arch(options.gpu_index) if options.device == "cuda" else None)
    tc = toolchain(options.device, arch)
    digest = spec_hash(spec, tc)
    cached = cache_dir("so", digest) / f"{spec.name}.so"
    build_dir = cache_dir("builds", short_hash(build_key, spec.name, tc.fingerprint))
    origin = cached.parent / "origin"
    if cached.exists():
        # Seed this solution's build directory from the one that produced the cached
        # module, so its next one-file edit is incremental too.
        if not (build_dir / "obj" / "build.ninja").exists() and origin.exists():
            _seed_build_dir(Path(origin.read_text().strip()), build_dir)
        return BuildResult(ok=True, module_name=spec.name, so_path=cached, message="build cached",
                           log="", duration_s=time.perf_counter() - t0, cached=True, build_dir=build_dir)
    with _locked(build_dir / ".lock"):
        src_dir = build_dir / "src"
        obj_dir = build_dir / "obj"
        obj_dir.mkdir(exist_ok=True)
        changed = _sync_sources(spec, src_dir)
        jobs = options.jobs or max(1, os.cpu_count() or 1)
        cfg = sandbox.SandboxConfig(**{**vars(options.sandbox), "timeout_s": options.timeout_s,
                                       "gpu_index": None, "address_space_mb": None})

        def ninja(pch: Mapping[str, Path], targets: list[str]) -> sandbox.RunResult:
            ninja_text = _ninja_file(spec, tc, pch)
            ninja_path = obj_dir / "build.ninja"
            if not ninja_path.exists() or ninja_path.read_text() != ninja_text:
                ninja_path.write_text(ninja_text)
            readonly: list[Path | tuple[Path, str]] = [Path(h).parent for h in pch.values()]
            readonly += [(TEMPLATES / name, str(src_dir / name)) for name in LOCKED_SOURCES if name in spec.sources]
            return sandbox.run([tc.ninja, "-C", str(obj_dir), f"-j{jobs}", *targets], cwd=obj_dir, writable=[build_dir],
                               readonly=readonly, env={"PATH": _path_env(tc.ninja, tc.nvcc), "TMPDIR": "/tmp"}, config=cfg)

        pch: dict[str, Path] = {}
        kinds = {rel: pch_kind(spec.sources[rel]) for rel in spec.compiled if not rel.endswith(".cu")}
        wanted = sorted({k for k in kinds.values() if k}) if options.use_pch else []
        missing = [k for k in wanted if not pch_built(tc, k)]
        for kind in set(wanted) - set(missing):
            header = ensure_pch(tc, kind)
            if header is not None:
                pch[kind] = header
        if missing:
            # A header not built yet (once per toolchain, tens of seconds) is built beside the
            # objects that do not need it (CUDA kernels above all); the rest follow.
            with ThreadPoolExecutor(len(missing)) as pool:
                building = {k: pool.submit(ensure_pch, tc, k) for k in missing}
                early = [_object_name(rel) for rel in spec.compiled if kinds.get(rel) not in missing]
                if early:
                    ninja(pch, early)  # (a failure here is reported by the full run below)
                headers = {k: f.result() for k, f in building.items()}
            pch.update({k: h for k, h in headers.items() if h is not None})
        run = ninja(pch, [])
        log = (run.stdout + run.stderr).strip()
        so = obj_dir / f"{spec.name}.so"
        dt = time.perf_counter() - t0
        rebuilt = [r.replace("../src/", "").replace(str(src_dir) + "/", "")
                   for r in re.findall(r"^\[\d+/\d+\] (.+)$", run.stdout, flags=re.M)]
        note = ("\n" + "\n".join(spec.notes)) if spec.notes else ""
        if run.timed_out:
            return BuildResult(ok=False, module_name=spec.name, so_path=None, log=log, duration_s=dt,
                               timed_out=True, build_dir=build_dir,
                               message=f"build timed out after {options.timeout_s:g} s" + note)
        if run.returncode != 0 or not so.exists():
            if so.exists():
                so.unlink()
            msg = trim_compiler_output(log, strip_prefixes=["../src/", str(src_dir) + "/", str(obj_dir) + "/"])
            return BuildResult(ok=False, module_name=spec.name, so_path=None, log=log, duration_s=dt,
                               build_dir=build_dir, message=(msg or run.describe()) + note, rebuilt=rebuilt)
        atomic_copy(so, cached)
        origin.write_text(str(build_dir))
    return BuildResult(ok=True, module_name=spec.name, so_path=cached, log=log, duration_s=dt,
                       build_dir=build_dir, rebuilt=rebuilt,
                       message=f"built {spec.name} ({len(changed)} source file(s) changed)" + note)


def _seed_build_dir(source: Path, target: Path) -> None:
    """Copy a finished build directory (sources, objects, ninja logs; mtimes kept)."""
    if not (source / "obj" / "build.ninja").exists() or source == target:
        return
    try:
        with _locked(source / ".lock"):
            for sub in ("src", "obj"):
                if (target / sub).exists():
                    shutil.rmtree(target / sub)
                shutil.copytree(source / sub, target / sub, symlinks=True)
    except OSError:
        shutil.rmtree(target / "obj", ignore_errors=True)


def _path_env(ninja: str, nvcc: str | None) -> str:
    """The PATH a build runs with."""
    dirs = [str(Path(ninja).parent), str(Path(sys.executable).parent)]
    if nvcc:
        dirs.append(str(Path(nvcc).parent))
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return ":".join(dict.fromkeys(dirs))
