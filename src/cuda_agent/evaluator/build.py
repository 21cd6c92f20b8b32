"""Compile a solution into one Python extension module, incrementally and cached.

Why not `torch.utils.cpp_extension.load`: it imports the module into the building
process, renames it (`cuda_extension_v1`) whenever sources change in a kept build
directory, and returns four hundred lines of ninja output on failure. Here we write the
ninja file ourselves:

- one kept build directory per solution (keyed by where the solution lives), whose
  sources are synced file by file, so editing one kernel recompiles only that file;
- a content-hash cache of finished modules, so an unchanged solution never rebuilds;
- a precompiled torch header for C++ files that include torch (parsing torch's headers
  is most of a small file's compile);
- the locked binding.cpp compiled once per toolchain and linked into every module (it is
  the same file in every workspace solution, and pybind11 takes seconds to compile);
- ninja runs inside the sandbox with only the build directory writable;
- compiler output comes back trimmed to the first errors with file:line.

The compiler set-up is in `toolchain.py`, the precompiled headers in `pch.py`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent import sandbox
from cuda_agent.evaluator.compiler_output import trim_compiler_output

# PCH_HEADERS is re-exported: the workspace commands read it from here.
from cuda_agent.evaluator.pch import PCH_HEADERS as PCH_HEADERS
from cuda_agent.evaluator.pch import build_once, ensure_pch, locked, pch_built, pch_kind
from cuda_agent.evaluator.solution import COMPILED_SUFFIXES, Solution
from cuda_agent.evaluator.toolchain import Toolchain, detect_arch, path_env, toolchain
from cuda_agent.files import atomic_copy, atomic_write
from cuda_agent.paths import TEMPLATES, cache_dir, short_hash

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
    use_object_cache: bool = True  # objects of unchanged sources reused across builds (`_object_key`)
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
# Ninja


def _object_name(rel: str) -> str:
    stem = rel.replace("/", "__")
    return stem + (".cuda.o" if rel.endswith(".cu") else ".o")


def _cflags(spec: ExtensionSpec, tc: Toolchain) -> list[str]:
    return [*tc.cflags, f"-DTORCH_EXTENSION_NAME={spec.name}", "-I../src", *spec.extra_cflags]


def _prebuilt_binding(spec: ExtensionSpec, tc: Toolchain, timeout_s: float) -> Path | None:
    """The object of the locked binding.cpp, compiled once per toolchain from the pristine
    templates (outside the sandbox, like the precompiled headers: nothing of a solution
    goes into it) and linked into every workspace module. None where the sources are not
    the workspace's pristine ones, or it does not compile (the build then compiles it)."""
    pristine = {name: (TEMPLATES / name).read_text() for name in LOCKED_SOURCES}
    if spec.extra_cflags or any(spec.sources.get(n) != text for n, text in pristine.items()):
        return None
    cflags = _cflags(spec, tc)
    d = cache_dir("binding", short_hash(tc.fingerprint, tc.cxx, *cflags, *pristine.values(), n=16))
    for name, text in pristine.items():
        if not (d / name).exists():
            atomic_write(d / name, text)
    obj = d / "binding.cpp.o"
    ok = build_once(obj, lambda tmp: [tc.cxx, *cflags, "-I", str(d), "-c", str(d / "binding.cpp"), "-o", str(tmp)],
                    timeout_s)
    return obj if ok else None


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def _object_key(spec: ExtensionSpec, tc: Toolchain, rel: str, pch: Mapping[str, Path]) -> str:
    """What a compiled object is made of: its source, every header of the solution (any of
    them may be included; all other compiled sources too where one is), the flags, the
    precompiled header and the toolchain. Objects with the same key are the same bytes."""
    compiled = set(spec.compiled)
    headers = {r: t for r, t in spec.sources.items() if r not in compiled}
    names = {Path(r).name for r in compiled}
    texts = [spec.sources[rel], *headers.values()]
    includes_compiled = any(Path(inc).name in names for t in texts for inc in _INCLUDE.findall(t))
    deps = spec.sources if includes_compiled else {rel: spec.sources[rel], **headers}
    parts = [tc.fingerprint, tc.cxx, *_cflags(spec, tc), rel, "|"]
    if rel.endswith(".cu"):
        parts += [tc.nvcc or "", *tc.cuda_cflags, *spec.extra_cuda_cflags, "|"]
    else:
        kind = pch_kind(spec.sources[rel])
        if kind and kind in pch:
            gch = Path(str(pch[kind]) + ".gch")
            st = gch.stat() if gch.exists() else None
            parts += [str(pch[kind]), f"{st.st_size}:{st.st_mtime_ns}" if st else "", "|"]
    for r in sorted(deps):
        parts += [r, deps[r]]
    return short_hash(*parts, n=32)


def _object_keys(spec: ExtensionSpec, tc: Toolchain, pch: Mapping[str, Path]) -> dict[str, Path]:
    """Each compiled source's place in the object cache (see `_object_key`)."""
    root = cache_dir("objects")
    return {rel: root / f"{_object_key(spec, tc, rel, pch)}.o" for rel in spec.compiled}


def _store_objects(places: Mapping[str, Path], obj_dir: Path) -> None:
    """After a build that succeeded, keep the objects it compiled for the next build of the
    same sources (an agent's edit of a kernel leaves its binding's object as it was).
    Written by the trusted side from what the sandboxed compiler made of exactly those
    sources; nothing of a build's own directory is trusted beyond that."""
    for rel, target in places.items():
        obj = obj_dir / _object_name(rel)
        if obj.is_file() and not obj.is_symlink() and not target.exists():
            with contextlib.suppress(OSError):
                atomic_copy(obj, target)


def _ninja_file(spec: ExtensionSpec, tc: Toolchain, pch: Mapping[str, Path], binding: Path | None = None,
                cached: Mapping[str, Path] | None = None) -> str:
    """Sources are named relative to the obj/ directory ninja runs in, so a build directory
    copied elsewhere stays valid (ninja sees the same commands and keeps its objects).
    `cached`: sources whose object is linked from the object cache instead of compiled."""
    q = shlex.quote
    cflags = _cflags(spec, tc)
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
    objects = [q(str(binding))] if binding is not None else []
    for rel in spec.compiled:
        if binding is not None and rel == "binding.cpp":
            continue
        if cached and rel in cached:
            objects.append(q(str(cached[rel])))
            continue
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
    with locked(build_dir / ".lock"):
        src_dir = build_dir / "src"
        obj_dir = build_dir / "obj"
        obj_dir.mkdir(exist_ok=True)
        changed = _sync_sources(spec, src_dir)
        jobs = options.jobs or max(1, os.cpu_count() or 1)
        cfg = sandbox.SandboxConfig(**{**vars(options.sandbox), "timeout_s": options.timeout_s,
                                       "gpu_index": None, "address_space_mb": None})

        binding = _prebuilt_binding(spec, tc, options.timeout_s)

        places: dict[str, Path] = {}  # each source's object in the object cache, for the last run's headers
        objects: dict[str, Path] = {}  # those of them already there: linked, not compiled

        def ninja(pch: Mapping[str, Path], targets: list[str]) -> sandbox.RunResult | None:
            places.clear()
            places.update(_object_keys(spec, tc, pch) if options.use_object_cache else {})
            objects.clear()
            objects.update({rel: obj for rel, obj in places.items() if obj.exists()})
            ninja_text = _ninja_file(spec, tc, pch, binding, objects)
            if targets:  # (an object taken from the cache has no build edge)
                targets = [t for t in targets if f"build {t}:" in ninja_text]
                if not targets:
                    return None
            ninja_path = obj_dir / "build.ninja"
            if not ninja_path.exists() or ninja_path.read_text() != ninja_text:
                ninja_path.write_text(ninja_text)
            readonly: list[Path | tuple[Path, str]] = [Path(h).parent for h in pch.values()]
            readonly += [binding.parent] if binding is not None else []
            readonly += list(objects.values())  # (these files alone: other solutions' objects stay unseen)
            readonly += [(TEMPLATES / name, str(src_dir / name)) for name in LOCKED_SOURCES if name in spec.sources]
            return sandbox.run([tc.ninja, "-C", str(obj_dir), f"-j{jobs}", *targets], cwd=obj_dir, writable=[build_dir],
                               readonly=readonly, env={"PATH": path_env(tc.ninja, tc.nvcc), "TMPDIR": "/tmp"}, config=cfg)

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
        assert run is not None
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
        _store_objects({rel: obj for rel, obj in places.items() if rel not in objects}, obj_dir)
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
        with locked(source / ".lock"):
            for sub in ("src", "obj"):
                if (target / sub).exists():
                    shutil.rmtree(target / sub)
                shutil.copytree(source / sub, target / sub, symlinks=True)
    except OSError:
        shutil.rmtree(target / "obj", ignore_errors=True)

