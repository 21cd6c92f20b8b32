"""Precompiled torch headers, built once per toolchain and shared by every build.

Parsing torch's headers is most of compiling a small C++ file that includes them, so a
source that includes torch is compiled with `-include` of the matching header
(`pch_kind`). A header that does not build is remembered (FAILED), and its sources compile
without it.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cuda_agent.evaluator.toolchain import Toolchain
from cuda_agent.paths import cache_dir

PCH_HEADERS = {
    "types": "#pragma once\n#include <torch/types.h>\n#include <torch/csrc/utils/pybind.h>\n",
    "extension": "#pragma once\n#include <torch/extension.h>\n",
}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made if missing): one process at a time
    writes a header, or a build directory."""
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


def build_once(target: Path, command: Callable[[Path], list[str]], timeout_s: float) -> bool:
    """Make `target` once, whoever asks first: `command(tmp)` writes a temporary file that
    replaces `target` when it succeeds; a failure is remembered (FAILED beside it, with
    the compiler's words) and never retried. True when `target` exists."""
    failed = target.parent / "FAILED"
    if target.exists():
        return True
    if failed.exists():
        return False
    with locked(target.parent / ".lock"):
        if target.exists():
            return True
        tmp = target.parent / f"{target.name}.tmp{os.getpid()}"
        try:
            proc = subprocess.run(command(tmp), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        if proc.returncode != 0 or not tmp.exists():
            failed.write_text(proc.stderr[-4000:])
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, target)
    return True


def ensure_pch(tc: Toolchain, kind: str, timeout_s: float = 900.0) -> Path | None:
    """Build (once per toolchain) a precompiled torch header; None if it cannot be built."""
    d = cache_dir("pch", tc.fingerprint, kind)
    header = d / "ca_prelude.h"
    if not (d / "ca_prelude.h.gch").exists():
        header.write_text(PCH_HEADERS[kind])
    ok = build_once(d / "ca_prelude.h.gch",
                    lambda tmp: [tc.cxx, "-x", "c++-header", str(header), "-o", str(tmp), *tc.cflags], timeout_s)
    return header if ok else None
