"""A solution: the candidate's files, read once from a workspace or a single file.

The evaluator trusts nothing else from the workspace: only these files are copied into
a fresh directory next to pristine locked files.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.files import LinkOutside, read_inside

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


def _read_text(root: Path, path: Path, rel: str) -> str:
    """A solution file's text, read without following a link below `root` (a workspace is
    written by the agent, and whoever evaluates it may read what the agent cannot)."""
    try:
        data = read_inside(root, path, MAX_FILE_BYTES)
    except LinkOutside:
        raise SolutionError(f"{rel} is a symbolic link or not a regular file; solution files must be plain "
                            "files in the solution's folder.") from None
    except ValueError:
        raise SolutionError(f"{rel} is larger than {MAX_FILE_BYTES} bytes; solution files are limited to "
                            f"{MAX_FILE_BYTES}.") from None
    except OSError as exc:
        raise SolutionError(f"{rel} cannot be read ({exc.strerror or exc}).") from None
    if b"\x00" in data:
        raise SolutionError(f"{rel} looks like a binary file (it contains NUL bytes); solution files are source text.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SolutionError(f"{rel} is not UTF-8 text ({exc}).") from None


def is_single_file_source(source: str) -> bool:
    return "load_inline" in source and "cpp_extension" in source


def load_solution(path: str | Path) -> Solution:
    """Read a workspace-format directory (`model_new.py` + `kernels/`) or one `model_new.py`.
    The path given is followed; no link below it is (`files.open_inside`)."""
    p = Path(path)
    if not p.exists():
        raise SolutionError(f"solution path {p} does not exist.")
    if p.is_file():
        if p.suffix != ".py":
            raise SolutionError(f"solution file {p} is not a Python file; give model_new.py or a workspace directory.")
        root = p.resolve().parent
        text = _read_text(root, root / p.name, p.name)
        files = {"model_new.py": text}
        fmt = SINGLE_FILE if is_single_file_source(text) else WORKSPACE
        if fmt == WORKSPACE:
            files.update(_read_kernels(root))
        return Solution(files=files, format=fmt, origin=str(p.resolve()))
    root = p.resolve()
    if not (root / "model_new.py").exists() and not (root / "model_new.py").is_symlink():
        raise SolutionError(f"solution directory {p} has no model_new.py.")
    text = _read_text(root, root / "model_new.py", "model_new.py")
    files = {"model_new.py": text, **_read_kernels(root)}
    fmt = SINGLE_FILE if is_single_file_source(text) and not any(
        k.endswith(COMPILED_SUFFIXES) for k in files if k != "model_new.py"
    ) else WORKSPACE
    return Solution(files=files, format=fmt, origin=str(p.resolve()))


def _read_kernels(root: Path) -> dict[str, str]:
    """The C++/CUDA sources under `root/kernels`, none reached through a link."""
    kernels = root / "kernels"
    if kernels.is_symlink():
        raise SolutionError("kernels is a symbolic link; the solution's kernels must be files in its kernels/ folder.")
    if not kernels.is_dir():
        return {}
    files: dict[str, str] = {}
    total = 0
    for folder, dirs, names in os.walk(kernels):  # (links to folders are listed, never entered)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            f = Path(folder) / name
            rel = "kernels/" + f.relative_to(kernels).as_posix()
            if f.suffix not in CPP_SUFFIXES:
                continue  # notes, logs, build leftovers: not part of the solution
            text = _read_text(root, f, rel)
            total += len(text)
            files[rel] = text
            if len(files) > MAX_FILES:
                raise SolutionError(f"kernels/ holds more than {MAX_FILES} source files.")
            if total > MAX_TOTAL_BYTES:
                raise SolutionError(f"kernels/ sources exceed {MAX_TOTAL_BYTES} bytes in all.")
    return dict(sorted(files.items()))


def solution_from_files(files: dict[str, str], *, origin: str = "<memory>") -> Solution:
    if "model_new.py" not in files:
        raise SolutionError("solution has no model_new.py.")
    for rel, text in files.items():
        if "\x00" in text:
            raise SolutionError(f"{rel} looks like a binary file (it contains NUL bytes); solution files are source "
                                "text.")
    fmt = SINGLE_FILE if is_single_file_source(files["model_new.py"]) and len(files) == 1 else WORKSPACE
    return Solution(files=dict(files), format=fmt, origin=origin)
