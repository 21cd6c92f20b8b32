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
from collections.abc import Iterator
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
    with locked(d / ".lock"):
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
