"""A solution: the candidate's files, read once from a workspace or a single file.

The evaluator trusts nothing else from the workspace: only these files are copied into
a fresh directory next to pristine locked files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

WORKSPACE = "workspace"
SINGLE_FILE = "single_file"

CPP_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".hxx", ".inl")
COMPILED_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx", ".c")
MAX_FILES = 64
MAX_FILE_BYTES = 1_000_000
MAX_TOTAL_BYTES = 4_000_000


class SolutionError(ValueError):
    """The solution cannot be read at all (a user mistake, not a verdict)."""


@dataclass(frozen=True)
class Solution:
    files: dict[str, str]  # relative posix path -> text; always holds "model_new.py"
    format: str  # WORKSPACE or SINGLE_FILE
    origin: str  # where it was read from, for messages and build-directory keys

    @property
    def model_new(self) -> str:
        return self.files["model_new.py"]

    @property
    def kernel_files(self) -> dict[str, str]:
        return {k: v for k, v in self.files.items() if k.startswith("kernels/")}

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256()
        h.update(self.format.encode())
        for name in sorted(self.files):
            h.update(b"\0" + name.encode() + b"\0" + self.files[name].encode())
        return h.hexdigest()[:16]


def _read_text(path: Path, rel: str) -> str:
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise SolutionError(f"{rel} is {len(data)} bytes; solution files are limited to {MAX_FILE_BYTES}.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SolutionError(f"{rel} is not UTF-8 text ({exc}).") from None


def is_single_file_source(source: str) -> bool:
    return "load_inline" in source and "cpp_extension" in source


def load_solution(path: str | Path) -> Solution:
    """Read a workspace-format directory (`model_new.py` + `kernels/`) or one `model_new.py`."""
    p = Path(path)
    if not p.exists():
        raise SolutionError(f"solution path {p} does not exist.")
    if p.is_file():
        if p.suffix != ".py":
            raise SolutionError(f"solution file {p} is not a Python file; give model_new.py or a workspace directory.")
        text = _read_text(p, p.name)
        files = {"model_new.py": text}
        kernels = p.parent / "kernels"
        fmt = SINGLE_FILE if is_single_file_source(text) else WORKSPACE
        if fmt == WORKSPACE and kernels.is_dir():
            files.update(_read_kernels(kernels))
        return Solution(files=files, format=fmt, origin=str(p.resolve()))
    model_new = p / "model_new.py"
    if not model_new.is_file():
        raise SolutionError(f"solution directory {p} has no model_new.py.")
    text = _read_text(model_new, "model_new.py")
    files = {"model_new.py": text}
    kernels = p / "kernels"
    if kernels.is_dir():
        files.update(_read_kernels(kernels))
    fmt = SINGLE_FILE if is_single_file_source(text) and not any(
        k.endswith(COMPILED_SUFFIXES) for k in files if k != "model_new.py"
    ) else WORKSPACE
    return Solution(files=files, format=fmt, origin=str(p.resolve()))


def _read_kernels(kernels: Path) -> dict[str, str]:
    files: dict[str, str] = {}
    total = 0
    for f in sorted(kernels.rglob("*")):
        if not f.is_file() or f.is_symlink() or "__pycache__" in f.parts:
            continue
        rel = "kernels/" + f.relative_to(kernels).as_posix()
        if f.suffix not in CPP_SUFFIXES:
            continue  # notes, logs, build leftovers: not part of the solution
        text = _read_text(f, rel)
        total += len(text)
        files[rel] = text
        if len(files) > MAX_FILES:
            raise SolutionError(f"kernels/ holds more than {MAX_FILES} source files.")
        if total > MAX_TOTAL_BYTES:
            raise SolutionError(f"kernels/ sources exceed {MAX_TOTAL_BYTES} bytes in all.")
    return files


def solution_from_files(files: dict[str, str], *, origin: str = "<memory>") -> Solution:
    if "model_new.py" not in files:
        raise SolutionError("solution has no model_new.py.")
    fmt = SINGLE_FILE if is_single_file_source(files["model_new.py"]) and len(files) == 1 else WORKSPACE
    return Solution(files=dict(files), format=fmt, origin=origin)
