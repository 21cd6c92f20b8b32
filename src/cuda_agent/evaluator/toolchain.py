"""The compiler set-up every extension build runs with: compilers, ninja, flags, libraries.

Working it out imports torch (seconds), so `toolchain` keeps it on disk under a key of what it
depends on that is readable without importing torch (`_toolchain_key`). Its `fingerprint`
keys the built modules and the precompiled headers, so a new torch or compiler rebuilds them.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cuda_agent import sandbox
from cuda_agent.files import atomic_write
from cuda_agent.paths import cache_dir, short_hash

# In every toolchain key and fingerprint: bump it when what a toolchain holds or how it is
# probed changes, so that cached toolchains, and the modules built with them, are not reused.
BUILD_PROTOCOL = "3"


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
    ldflags[2:2] = _fast_linker(cxx, [*ldflags, *cuda_ldflags], path_env(ninja, nvcc))
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
    torch's libraries, which the faster linkers do in about half GNU ld's time (figures:
    docs/design-log.md).

    The probe links as a build does: a C++ shared object (the C++ driver adds libstdc++)
    with `link_args` (OpenMP, torch's and CUDA's libraries), in the sandbox where there is
    one, with the builds' PATH. A linker that links C can still fail there: gold stops at a
    `libstdc++.so` that links to nothing (a compiler installed under /opt with links into
    /usr), where GNU ld skips such a file and searches on."""
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


def path_env(ninja: str, nvcc: str | None) -> str:
    """The PATH a build runs with (and the linker probe, so it finds the same tools)."""
    dirs = [str(Path(ninja).parent), str(Path(sys.executable).parent)]
    if nvcc:
        dirs.append(str(Path(nvcc).parent))
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return ":".join(dict.fromkeys(dirs))
