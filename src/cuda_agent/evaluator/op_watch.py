"""A watch on every ATen operator the candidate's process runs, from any thread.

The guard inside a trial's forward (`guards.ComputeOpGuard`, a Python dispatch mode) sees
only the calling thread, and only what reaches the Python dispatch key: ATen called from
C++ on an OpenMP thread, or under `c10::impl::ExcludeDispatchKeyGuard`, passes it, and it
is not on during import, `__init__` or timing. This watch is a global RecordFunction
callback, which the dispatcher runs for every observed operator call, on every thread,
whatever dispatch keys a thread excluded. It is a small C++ extension of the evaluator's
own (`SOURCE`), built once per toolchain outside the sandbox (`ensure_built`) and loaded
into the candidate's process before any candidate code.

What it counts: on the main thread, the operators that run while candidate code runs
there (`Watch.candidate()`: importing the extension and `model_new.py`, `__init__`, each
call); on every other thread, every operator at any time, except the chunks ATen's own
intra-op workers run for an evaluator operator (they are inside a parallel region while
the main thread is not running candidate code). `judge` turns the counts into a verdict.

Like everything in that process, the counts are the candidate's to forge: native code can
disable RecordFunction on its thread or call kernels without the dispatcher (the static
checks flag those spellings). Breaking the rule this way buys nothing the parent's
checks of outputs and times would give it (see the evaluator README).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cuda_agent.evaluator.static_checks.vocabulary import ADL_COMPUTE, COMPUTE_METHODS

NAME = "cuda_agent_op_watch"

SOURCE = r"""
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace {
std::atomic<bool> armed{false};
std::atomic<int> candidate_on_main{0};
thread_local bool in_candidate = false;
std::thread::id main_thread;
std::mutex mu;
std::map<std::string, long long> on_main, elsewhere;
at::CallbackHandle handle = 0;

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (!armed.load(std::memory_order_relaxed)) return nullptr;
  const bool main = std::this_thread::get_id() == main_thread;
  if (main && !in_candidate) return nullptr;  // the evaluator's own operators
  if (!main && at::in_parallel_region() && candidate_on_main.load() == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  (main ? on_main : elsewhere)[fn.name()] += 1;
  return nullptr;
}

pybind11::dict take() {
  std::lock_guard<std::mutex> lock(mu);
  pybind11::dict out, m, e;
  for (auto& kv : on_main) m[pybind11::str(kv.first)] = kv.second;
  for (auto& kv : elsewhere) e[pybind11::str(kv.first)] = kv.second;
  out["main"] = m;
  out["elsewhere"] = e;
  on_main.clear();
  elsewhere.clear();
  return out;
}
}  // namespace

PYBIND11_MODULE(cuda_agent_op_watch, m) {
  m.def("arm", [] {
    main_thread = std::this_thread::get_id();
    if (handle == 0) {
      handle = at::addGlobalCallback(
          at::RecordFunctionCallback(on_enter).scopes({at::RecordScope::FUNCTION}));
    }
    armed = true;
  });
  m.def("candidate", [](bool on) {
    in_candidate = on;
    candidate_on_main += on ? 1 : -1;
  });
  m.def("take", &take);
}
"""


def _built_path(device: str) -> tuple[Any, Path]:
    from cuda_agent.evaluator.toolchain import toolchain
    from cuda_agent.paths import cache_dir

    tc = toolchain(device)
    return tc, cache_dir("op-watch", tc.fingerprint) / f"{NAME}.so"


def ensure_built(device: str, timeout_s: float = 600.0) -> Path | None:
    """The watch extension for `device`'s toolchain, built once (None: it does not build
    here, and the candidate runs without it; the reason is kept in FAILED)."""
    from cuda_agent.evaluator.pch import build_once, ensure_pch

    tc, so = _built_path(device)
    if so.exists():
        return so
    src = so.parent / f"{NAME}.cpp"
    if not src.exists():
        src.write_text(SOURCE)
    pch = ensure_pch(tc, "types")  # the headers every extension's build parses, parsed once

    def command(tmp: Path) -> list[str]:
        return [tc.cxx, *(["-include", str(pch)] if pch else []), str(src), "-o", str(tmp), *tc.cflags, *tc.ldflags]

    return so if build_once(so, command, timeout_s) else None


class Watch:
    """The candidate process's side (`path` empty: no watch, every method does nothing)."""

    def __init__(self, path: str) -> None:
        self.ext: Any = None
        self.phases: dict[str, dict[str, dict[str, int]]] = {}
        if path:
            import importlib.machinery
            import importlib.util

            loader = importlib.machinery.ExtensionFileLoader(NAME, path)
            spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
            assert spec is not None
            self.ext = importlib.util.module_from_spec(spec)
            loader.exec_module(self.ext)
            self.ext.arm()

    @contextlib.contextmanager
    def candidate(self) -> Iterator[None]:
        """Candidate code runs on this (the main) thread meanwhile."""
        if self.ext is not None:
            self.ext.candidate(True)
        try:
            yield
        finally:
            if self.ext is not None:
                self.ext.candidate(False)

    def wrap(self, fn: Any) -> Any:
        """`fn` called as candidate code."""

        def call(*args: Any) -> Any:
            with self.candidate():
                return fn(*args)

        return call

    def close(self, phase: str) -> None:
        """File what ran since the last phase under `phase`."""
        if self.ext is None:
            return
        got = self.ext.take()
        for where in ("main", "elsewhere"):
            if got[where]:
                bucket = self.phases.setdefault(phase, {}).setdefault(where, {})
                for name, n in dict(got[where]).items():
                    bucket[str(name)] = bucket.get(str(name), 0) + int(n)


# Operators that compute: the static checks' vocabulary, plus ATen's own names beneath the
# composite ones (`linear` becomes `addmm`, `softmax` becomes `_softmax`, ...).
_PREFIXES = ("conv", "cudnn_", "mkldnn_", "miopen_", "native_", "max_pool", "avg_pool", "adaptive_",
             "upsample_", "scaled_dot_product", "fused", "foreach_", "linalg_", "fft")
# Where `__init__` may compute (initialising parameters, which load_state_dict replaces):
# only these, a model's heavy work, betray a forward run there.
_INIT_HEAVY = frozenset("""
mm bmm matmul addmm addbmm baddbmm linear einsum softmax log_softmax layer_norm batch_norm
group_norm instance_norm embedding
""".split())


def compute_op(name: str, init: bool = False) -> bool:
    """Whether the operator `name` ("aten::mm", "aten::add_") is compute (for `__init__`:
    the heavy kind only)."""
    root = name.split("::", 1)[-1].split(".", 1)[0].lstrip("_").rstrip("_")
    if init:
        return root in _INIT_HEAVY or root.startswith(_PREFIXES[:10])
    return root in COMPUTE_METHODS or root in ADL_COMPUTE or root.startswith(_PREFIXES)


def judge(phases: dict[str, Any]) -> tuple[str, str] | None:
    """The first broken rule in a report's watch counts: (phase, message), or None."""
    for phase, where in phases.items():
        if not isinstance(where, dict):
            continue
        for thread in ("elsewhere", "main"):
            ops = where.get(thread) or {}
            bad = sorted(n for n in ops if isinstance(n, str) and compute_op(n, init=phase == "__init__"
                                                                               and thread == "main"))
            if bad:
                on = "on another thread " if thread == "elsewhere" else ""
                return phase, (f"torch compute operator {bad[0]} ran {on}during {phase} (all: "
                               f"{', '.join(bad[:6])}); only allocation, views and the extension's own kernels "
                               "are allowed, from any thread, at any time.")
    return None
