"""Trimming real compiler output: fixtures come from compiling small broken files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cuda_agent.evaluator.compiler_output import first_error_location, trim_compiler_output

GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
NINJA = shutil.which("ninja")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ is not installed")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
needs_ninja = pytest.mark.skipif(NINJA is None or GXX is None, reason="ninja/g++ missing")

# Flags shaped like torch's cpp_extension command lines, so the failing command is long.
TORCH_LIKE_FLAGS = " ".join(
    ["-MMD", "-DTORCH_EXTENSION_NAME=cuda_extension", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    + [f"-isystem /opt/fake/site-packages/torch/include/dir{i}" for i in range(12)]
    + ["-fPIC", "-std=c++17", "-O3"]
)

BROKEN_CPP = """\
#include <vector>
int scale(int x) { return x * 2; }
int main() {
  int z = y + 1;
  std::vector<int> v;
  v.push_back("s");
  return scale(z, 3);
}
"""

BROKEN_CU = """\
#include <cuda_runtime.h>
template <typename T>
__global__ void axpby(T* x, int n) { x[threadIdx.x] = undefined_thing(n); }
__global__ void k2(float* x) { x[0] = 1.0f }
void launch(float* x) { axpby<float><<<1, 32>>>(x, 3); }
"""

# nvcc reports instantiation errors only when parsing found none.
INSTANTIATION_CU = """\
template <typename T>
__global__ void k3(T* x) { T y = T::zero(); x[0] = y; }
void launch(float* x) { k3<float><<<1, 32>>>(x); }
"""

TEMPLATE_IN_HEADER = """\
#include <algorithm>
#include <vector>
struct Point { int a; };
void sort_points(std::vector<Point>& v) {
  std::sort(v.begin(), v.end());
}
"""


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, "the fixture was supposed to fail to build"
    return proc.stdout + proc.stderr


def _write(root: Path, name: str, text: str) -> Path:
    path = root / "kernels" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def ninja_gxx_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """What ninja prints when g++ fails on a workspace kernel (as cpp_extension runs it)."""
    if NINJA is None or GXX is None:
        pytest.skip("ninja/g++ missing")
    root = tmp_path_factory.mktemp("workspace")
    source = _write(root, "broken_binding.cpp", BROKEN_CPP)
    build = root / "build"
    build.mkdir()
    (build / "build.ninja").write_text(
        "ninja_required_version = 1.3\n"
        f"cxx = {GXX}\n"
        "rule compile\n"
        f"  command = $cxx {TORCH_LIKE_FLAGS} -MF $out.d -c $in -o $out\n"
        "  depfile = $out.d\n"
        "  deps = gcc\n"
        f"build broken_binding.o: compile {source}\n"
    )
    return _run([NINJA, "-v"], build), root


def test_ninja_log_is_cut_to_the_errors(ninja_gxx_log: tuple[str, Path]) -> None:
    raw, root = ninja_gxx_log
    assert "FAILED:" in raw and "-isystem" in raw  # the fixture is realistic
    out = trim_compiler_output(raw, strip_prefixes=[str(root)])
    assert out.startswith("kernels/broken_binding.cpp:4:11: error: ‘y’ was not declared") or (
        out.startswith("kernels/broken_binding.cpp:4:11: error: 'y' was not declared")
    )
    assert "    4 |   int z = y + 1;" in out  # the source line and its caret stay
    assert "      |           ^" in out
    assert "kernels/broken_binding.cpp:6:" in out and "kernels/broken_binding.cpp:7:" in out
    for noise in ("-isystem", "FAILED", "ninja", "In file included from", str(root)):
        assert noise not in out
    assert len(out) < 4000
    assert len(out) < len(raw)
    assert first_error_location(raw, strip_prefixes=[str(root)]) == (
        "kernels/broken_binding.cpp",
        4,
    )


def test_error_count_is_capped_and_reported(ninja_gxx_log: tuple[str, Path]) -> None:
    raw, root = ninja_gxx_log
    out = trim_compiler_output(raw, max_errors=1, strip_prefixes=[str(root)])
    assert out.count(": error:") == 1
    assert out.endswith("more errors not shown)")
    total = trim_compiler_output(raw, max_errors=100, strip_prefixes=[str(root)]).count(": error:")
    assert out.endswith(f"({total - 1} more errors not shown)")


def test_notes_are_capped(ninja_gxx_log: tuple[str, Path]) -> None:
    raw, root = ninja_gxx_log
    out = trim_compiler_output(raw, strip_prefixes=[str(root)])
    blocks = out.split("kernels/broken_binding.cpp:")
    assert all(block.count("note:") <= 2 for block in blocks)
    assert "stl_vector.h" not in out.split("note:")[0]  # header notes do not lead


def test_without_prefixes_absolute_paths_stay(ninja_gxx_log: tuple[str, Path]) -> None:
    raw, root = ninja_gxx_log
    out = trim_compiler_output(raw)
    assert out.startswith(str(root / "kernels" / "broken_binding.cpp") + ":4:11: error:")
    assert first_error_location(raw) == (str(root / "kernels" / "broken_binding.cpp"), 4)


@needs_nvcc
def test_nvcc_errors_are_rewritten_to_file_line(tmp_path: Path) -> None:
    source = _write(tmp_path, "axpby.cu", BROKEN_CU)
    raw = _run([NVCC, "-c", str(source), "-o", str(tmp_path / "axpby.o")], tmp_path)
    assert f"{source}(3): error" in raw  # nvcc's own format
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    lines = out.splitlines()
    assert lines[0] == 'kernels/axpby.cu:3: error: identifier "undefined_thing" is undefined'
    assert "undefined_thing(n)" in lines[1] and lines[2].strip() == "^"
    assert 'kernels/axpby.cu:4: error: expected a ";"' in out
    assert "errors detected in the compilation" not in out
    assert first_error_location(raw, strip_prefixes=[str(tmp_path)]) == ("kernels/axpby.cu", 3)

    source = _write(tmp_path, "k3.cu", INSTANTIATION_CU)
    raw = _run([NVCC, "-c", str(source), "-o", str(tmp_path / "k3.o")], tmp_path)
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    assert out.startswith("kernels/k3.cu:2: error: name followed by")
    assert 'detected during instantiation of "void k3(T *) [with T=float]" at line 3' in out


@needs_nvcc
def test_ptxas_resource_errors_survive(tmp_path: Path) -> None:
    source = _write(
        tmp_path,
        "smem.cu",
        "__global__ void k(float* x) { __shared__ float s[1 << 20]; s[threadIdx.x] = 1;"
        " x[0] = s[5]; }\n",
    )
    raw = _run([NVCC, "-c", str(source), "-o", str(tmp_path / "smem.o")], tmp_path)
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    assert out.startswith("ptxas: error: Entry function")
    assert "too much shared data" in out
    assert first_error_location(raw) is None


@needs_gxx
def test_template_error_in_header_points_at_user_line(tmp_path: Path) -> None:
    source = _write(tmp_path, "sort.cpp", TEMPLATE_IN_HEADER)
    raw = _run([GXX, "-c", str(source), "-o", str(tmp_path / "sort.o")], tmp_path)
    assert "required from here" in raw and len(raw) > 3000
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    first = out.splitlines()[0]
    assert first.startswith("kernels/sort.cpp:5:")
    assert "error: no match for" in first
    assert "reported in /usr/include/" in out
    assert "required from" not in out
    assert len(out) < 1500
    assert first_error_location(raw, strip_prefixes=[str(tmp_path)]) == ("kernels/sort.cpp", 5)


@needs_gxx
def test_missing_header_and_colour_codes(tmp_path: Path) -> None:
    source = _write(tmp_path, "inc.cpp", '#include "nothere.h"\nint f();\n')
    raw = _run(
        [GXX, "-fdiagnostics-color=always", "-c", str(source), "-o", str(tmp_path / "i.o")],
        tmp_path,
    )
    assert "\x1b[" in raw
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    assert "\x1b" not in out
    assert out.splitlines()[0] == (
        "kernels/inc.cpp:1:10: fatal error: nothere.h: No such file or directory"
    )
    assert "compilation terminated" not in out


@needs_gxx
def test_link_errors(tmp_path: Path) -> None:
    source = _write(tmp_path, "link.cpp", "int missing(int);\nint main() { return missing(3); }\n")
    raw = _run([GXX, str(source), "-o", str(tmp_path / "link")], tmp_path)
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    assert "undefined reference to `missing(int)'" in out
    assert "ld returned 1 exit status" not in out
    assert first_error_location(raw) is None


@needs_gxx
def test_warnings_are_not_errors(tmp_path: Path) -> None:
    source = _write(
        tmp_path,
        "warn.cpp",
        "int f() {\n  int unused = 3;\n  return 1\n}\n",
    )
    raw = _run([GXX, "-Wall", "-c", str(source), "-o", str(tmp_path / "w.o")], tmp_path)
    assert "warning:" in raw
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    assert "warning" not in out
    assert out.splitlines()[0].startswith("kernels/warn.cpp:3:11: error: expected ‘;’") or (
        out.splitlines()[0].startswith("kernels/warn.cpp:3:11: error: expected ';'")
    )


@needs_gxx
def test_many_errors_fit_the_character_budget(tmp_path: Path) -> None:
    body = "".join(f"int f{i}() {{ return undefined_{i}; }}\n" for i in range(60))
    source = _write(tmp_path, "many.cpp", body)
    raw = _run([GXX, "-c", str(source), "-o", str(tmp_path / "m.o")], tmp_path)
    out = trim_compiler_output(raw, max_errors=50, max_chars=600, strip_prefixes=[str(tmp_path)])
    assert len(out) <= 600
    assert out.startswith("kernels/many.cpp:1:")
    assert out.endswith("more errors not shown)")


def test_repeated_errors_are_shown_once() -> None:
    one = 'kernels/a.cu(7): error: identifier "q" is undefined\n  int z = q;\n          ^\n\n'
    out = trim_compiler_output(one * 3 + '3 errors detected in the compilation of "a.cu".\n')
    assert out.count("error:") == 1
    assert "more errors" not in out


def test_long_lines_are_clipped() -> None:
    raw = "x.cpp:1:1: error: no match for " + "T<" * 2000 + "\n"
    out = trim_compiler_output(raw, max_chars=1000)
    assert len(out) < 400
    assert out.startswith("x.cpp:1:1: error: no match for T<T<")
    assert out.endswith("...")


def test_site_packages_paths_are_shortened() -> None:
    header = "/opt/venv/lib/python3.11/site-packages/torch/include/ATen/core/TensorBody.h"
    raw = f"{header}:12:3: error: static assertion failed\n"
    out = trim_compiler_output(raw)
    assert out == "torch/include/ATen/core/TensorBody.h:12:3: error: static assertion failed"


def test_unrecognised_output_falls_back_to_its_tail() -> None:
    raw = "[1/2] c++ -c main.cpp -o main.o -isystem /x -isystem /y\n" + "\n".join(
        f"line {i}" for i in range(40)
    )
    out = trim_compiler_output(raw + "\nSomething odd broke the build\n")
    assert out.endswith("Something odd broke the build")
    assert "line 5\n" not in out and "[1/2]" not in out
    assert trim_compiler_output("") != ""
    assert trim_compiler_output("   \n\n") != ""
    assert first_error_location("nothing here") is None


@pytest.mark.slow
@needs_gxx
def test_torch_header_noise_is_trimmed(tmp_path: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    source = _write(
        tmp_path,
        "noisy_binding.cpp",
        "#include <torch/types.h>\n"
        "struct Foo {};\n"
        "at::Tensor f(const at::Tensor& x) {\n"
        "  at::Tensor t = x + Foo{};\n"
        "  c10::ArrayRef<int> r(Foo{});\n"
        "  return t;\n"
        "}\n",
    )
    flags = [arg for path in include_paths() for arg in ("-isystem", path)]
    raw = _run(
        [GXX, "-std=c++17", *flags, "-fsyntax-only", str(source)],
        tmp_path,
    )
    assert raw.count("note:") > 20 and "In file included from" in raw  # really noisy
    out = trim_compiler_output(raw, strip_prefixes=[str(tmp_path)])
    lines = out.splitlines()
    assert lines[0].startswith("kernels/noisy_binding.cpp:4:")
    assert "operator+" in lines[0]
    assert any(line.startswith("kernels/noisy_binding.cpp:5:") for line in lines)
    assert "In file included from" not in out and "site-packages" not in out
    assert out.count("note:") <= 4
    assert len(out) < 2500 and len(out) * 5 < len(raw)
    assert first_error_location(raw, strip_prefixes=[str(tmp_path)]) == (
        "kernels/noisy_binding.cpp",
        4,
    )
