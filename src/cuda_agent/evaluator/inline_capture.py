"""Capture the `load_inline` calls of a KernelBench single-file solution (sandboxed).

`python -m cuda_agent.evaluator.inline_capture RUN_DIR OUT.json` executes model_new.py
with `torch.utils.cpp_extension.load_inline` replaced by a recorder, so the evaluator
can compile the sources with its own cached, incremental, sandboxed build instead of
letting the candidate drive the compiler. The recorded arguments are data, never code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cuda_agent.evaluator.protocol import CaptureReport

_FIELDS = ("name", "cpp_sources", "cuda_sources", "functions", "extra_cflags", "extra_cuda_cflags",
           "extra_ldflags", "with_cuda")


class _Placeholder:
    """Stands for the module until the real build exists; any use at import time is harmless."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        def later(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{self._name}.{attr} called while model_new.py was being imported")

        return later


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    if isinstance(v, dict):
        return {str(k): str(x) for k, x in v.items()}
    return str(v)


def main(run_dir: str, out_path: str) -> int:
    calls: list[dict[str, Any]] = []
    try:
        import torch.utils.cpp_extension as ce

        def record(name: str, cpp_sources: Any = None, cuda_sources: Any = None, functions: Any = None,
                   **kwargs: Any) -> _Placeholder:
            call = {"name": name, "cpp_sources": cpp_sources, "cuda_sources": cuda_sources,
                    "functions": functions, **kwargs}
            calls.append({k: _plain(call.get(k)) for k in _FIELDS})
            return _Placeholder(str(name))

        ce.load_inline = record  # type: ignore[assignment]
        sys.path.insert(0, run_dir)
        source = (Path(run_dir) / "model_new.py").read_text()
        code = compile(source, "model_new.py", "exec")
        exec(code, {"__name__": "model_new", "__file__": str(Path(run_dir) / "model_new.py")})
        CaptureReport(ok=True, calls=calls).write(Path(out_path))
    except BaseException as exc:
        CaptureReport(ok=False, calls=calls, error=f"{type(exc).__name__}: {exc}"[:2000]).write(Path(out_path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
