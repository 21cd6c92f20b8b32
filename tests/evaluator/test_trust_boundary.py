"""Hostile solutions whose native code controls the candidate's process: a forged report,
a forged clock, work skipped when timed (found by the stack, by a fingerprint of inputs
seen before, by the gap since the last call), work left running after the call returns,
a patched comparison, ATen compute the forward's guard cannot see. None may win what it
did not earn: the parent decides from its own batches, timed by its own clock, from
outputs committed before it chose which to check, and from a watch on every operator.

Every hostile behaviour lives in one extension (built once; the solutions differ only in
model_new.py, which picks a behaviour), so the suite pays for one build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules

from . import cases as C
from .test_profile_cpu import prof


def python_at_load(code: str) -> str:
    """A C++ file whose static initialiser runs `code` when the extension is loaded."""
    return ('#include <Python.h>\n\nnamespace {\nstruct Forge {\n  Forge() { PyRun_SimpleString(R"PY(\n'
            + code + '\n)PY"); }\n} forge;\n}  // namespace\n')


# Python the native code runs in the candidate's interpreter (cuda_extension.forge(NAME)).
FORGES = {
    # times the real work, then writes a report 20x faster and leaves before the parent's batches
    "report": '''
import json, os
import cuda_agent.evaluator.timing as T
import cuda_agent.evaluator.vouch as V
_real = T.measure
def _measure(*a, **k):
    res = _real(*a, **k)
    m = res["candidate"]
    m.device_us[:] = [x / 20 for x in m.device_us]
    m.wall_us[:] = [x / 20 for x in m.wall_us]
    return res
T.measure = _measure
def _leave(self, *a, **k):
    r = json.load(open("out/report.json"))
    r["ok"] = True
    open("out/report.json", "w").write(json.dumps(r))
    open("out/device-free", "w").close()
    os._exit(0)
V.Serve.run = _leave
''',
    # the timing module's clock, 50 times slower while the candidate's own calls are timed
    # (one slow for everything would slow the device probe beside them too, and the
    # speedups would shrink with it)
    "clock": '''
import cuda_agent.evaluator.timing as T
_real = T._perf_ns
_slow = [False]
T._perf_ns = lambda: _real() // 50 if _slow[0] else _real()
_time_call = T._CpuClock.time_call
def time_call(self, fn):
    _slow[0] = fn.__defaults__ == ("candidate",)
    try:
        return _time_call(self, fn)
    finally:
        _slow[0] = False
T._CpuClock.time_call = time_call
''',
    # every comparison says "equal"
    "equal": '''
import torch
torch.equal = lambda *a, **k: True
torch.Tensor.__eq__ = lambda self, other: torch.ones(self.shape, dtype=torch.bool)
''',
    # the outputs become links to the reference's expected outputs, and saves do nothing
    "links": '''
import os, torch
torch.save = lambda *a, **k: None
for k in range(16):
    os.symlink(f'../../private/expected_{k}.pt', f'out/out_{k}.pt')
''',
    # a Python thread for model_new.py to leave work to
    "later": '''
import builtins, threading, time
def later(fn, *args):
    def go():
        time.sleep(0.001)
        fn(*args)
    threading.Thread(target=go, daemon=True).start()
builtins.later = later
''',
}
FORGED_REPORT = python_at_load(FORGES["report"])  # (the GPU tests load it at load time)

_STACK = '''
static bool timed() {  // is a timing function on the interpreter's stack?
  PyFrameObject* f = PyEval_GetFrame();
  Py_XINCREF(f);
  bool found = false;
  while (f != nullptr && !found) {
    PyCodeObject* code = PyFrame_GetCode(f);
    PyObject* name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_name");
    const char* s = name ? PyUnicode_AsUTF8(name) : nullptr;
    found = s && (std::strcmp(s, "time_call") == 0 || std::strcmp(s, "run_batch") == 0);
    Py_XDECREF(name);
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  return found;
}
'''

HOSTILE = C.BINDING_HEAD + '''
#include <Python.h>
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <omp.h>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>

extern "C" void axpby_launcher(float*, const float*, const float*, float, int64_t);
''' + _STACK + '''
static torch::Tensor run(const torch::Tensor& a, const torch::Tensor& b, double alpha) {
  auto out = torch::empty_like(a);
  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());
  return out;
}

static std::map<std::string, std::string> forges = {FORGES};
static void forge(const std::string& name) { PyRun_SimpleString(forges.at(name).c_str()); }

static torch::Tensor plain(torch::Tensor a, torch::Tensor b, double alpha) { return run(a, b, alpha); }

// skips the work whenever a timing function is on the stack
static torch::Tensor stack_skip(torch::Tensor a, torch::Tensor b, double alpha) {
  if (timed()) return torch::empty_like(a);
  return run(a, b, alpha);
}

// computes only for inputs seen in the trials (six floats of the first input)
static std::set<std::array<float, 6>> seen;
static int calls = 0;
static torch::Tensor fingerprint_skip(torch::Tensor a, torch::Tensor b, double alpha) {
  const float* p = a.data_ptr<float>();
  std::array<float, 6> fp{p[0], p[1], p[2], p[3], p[4], p[5]};
  if (++calls <= {TRIALS}) seen.insert(fp);
  else if (!seen.count(fp)) return torch::empty_like(a);
  return run(a, b, alpha);
}

// computes only after a pause: calls back to back are timed ones
static auto last = std::chrono::steady_clock::now() - std::chrono::seconds(10);
static torch::Tensor gap_skip(torch::Tensor a, torch::Tensor b, double alpha) {
  auto now = std::chrono::steady_clock::now();
  double gap = std::chrono::duration<double>(now - last).count();
  last = now;
  if (gap < 0.003) return torch::empty_like(a);
  return run(a, b, alpha);
}

// returns at once; a detached thread does the work a millisecond later
static torch::Tensor deferred(torch::Tensor a, torch::Tensor b, double alpha) {
  auto out = torch::empty_like(a);
  std::thread([=]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());
  }).detach();
  return out;
}

static void into(torch::Tensor out, torch::Tensor a, torch::Tensor b, double alpha) {
  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());
}

// the right answer, then its first input zeroed
static torch::Tensor mutate(torch::Tensor a, torch::Tensor b, double alpha) {
  auto out = run(a, b, alpha);
  std::memset(a.data_ptr<float>(), 0, a.numel() * sizeof(float));
  return out;
}

// the answer from ATen, on an OpenMP worker thread
static torch::Tensor omp_aten(torch::Tensor a, torch::Tensor b, double alpha) {
  auto out = torch::empty_like(a);
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == 1) at::add_out(out, b, a, alpha);
  }
  return out;
}

// the answer from ATen with the Python dispatch key (the forward's guard) excluded
static torch::Tensor excluded_aten(torch::Tensor a, torch::Tensor b, double alpha) {
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return at::add(b, a, alpha);
}

// the kernel while verified, ATen while timed
static torch::Tensor aten_when_timed(torch::Tensor a, torch::Tensor b, double alpha) {
  if (timed()) return at::add(b, a, alpha);
  return run(a, b, alpha);
}

// a matrix product, for __init__
static torch::Tensor warm(torch::Tensor w) { return at::mm(w, w.t()); }

static void register_hostile(pybind11::module& m) {
  m.def("forge", &forge);
  m.def("axpby", &plain);
  m.def("stack_skip", &stack_skip);
  m.def("fingerprint_skip", &fingerprint_skip);
  m.def("gap_skip", &gap_skip);
  m.def("deferred", &deferred);
  m.def("into", &into);
  m.def("mutate", &mutate);
  m.def("omp_aten", &omp_aten);
  m.def("excluded_aten", &excluded_aten);
  m.def("aten_when_timed", &aten_when_timed);
  m.def("warm", &warm);
}
REGISTER_BINDING(hostile, register_hostile);
'''.replace("{TRIALS}", str(C.TRIALS)).replace("{FORGES}", "{" + ", ".join(f'{{"{k}", R"PY({v})PY"}}' for k, v in FORGES.items()) + "}")


def hostile(call: str = "axpby", forge: str | None = None, body: str | None = None, init: str = "") -> dict[str, str]:
    """The axpby solution with the hostile extension: forward calls `call`, after `forge`."""
    model_new = C.forward(body or f"return cuda_extension.{call}(a, b, self.alpha)", init=init)
    if forge:
        model_new = model_new.replace("import cuda_extension\n", f"import cuda_extension\ncuda_extension.forge({forge!r})\n")
    files = C.axpby(model_new, axpby_binding__cpp=HOSTILE)
    return files


def evaluate(tmp_path: Path, files: dict[str, str]) -> R.EvalResult:
    return prof(tmp_path, files, static_checks=False)


def not_won(res: R.EvalResult) -> None:
    """Either the verdict is against it, or the speedups counted are the parent's own."""
    if res.status == "ok":
        vouched = res.details["vouched"]
        assert R.FLAG_UNVOUCHED in res.flags, (res.message, vouched)
        assert res.speedup_vs_eager <= vouched["speedup_vs_eager"], vouched
        assert res.speedup_vs_compile <= vouched["speedup_vs_compile"], vouched


def test_the_hostile_extension_computes_right_when_it_chooses_to(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile())
    assert res.status == "ok" and not res.details.get("watch"), res.message


def test_a_forged_report_and_an_early_exit_win_nothing(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile(forge="report"))
    assert res.status == "runtime_error" and res.reward == -1.0 and res.rule == rules.VOUCHED, res.message
    assert "ended before its timed batches" in res.message


def test_a_forged_clock_counts_the_parents_time(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile(forge="clock"))
    assert res.status == "ok", res.message
    inside = res.details["vouched"]["in_process"]["speedup_vs_eager"]
    assert inside > 10, res.details["vouched"]  # what the forged clock claimed
    not_won(res)
    assert res.speedup_vs_eager < inside / 3, res.details["vouched"]


def test_work_skipped_when_a_timing_function_is_on_the_stack_fails(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile("stack_skip"))
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message
    assert "batch" in res.message


def test_computing_only_for_inputs_seen_before_fails(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile("fingerprint_skip"))
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message


def test_computing_only_after_a_pause_wins_nothing(tmp_path: Path) -> None:
    not_won(evaluate(tmp_path, hostile("gap_skip")))


def test_work_left_to_a_native_thread_fails(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile("deferred"))
    assert res.status == "incorrect", res.message


def test_work_left_to_a_python_thread_fails(tmp_path: Path) -> None:
    body = ("out = torch.empty_like(a)\ncuda_extension.into(out[:1], a[:1], b[:1], self.alpha)\n"
            "later(cuda_extension.into, out, a, b, self.alpha)\nreturn out")
    res = evaluate(tmp_path, hostile(forge="later", body=body))
    assert res.status == "incorrect", res.message


def test_a_mutation_hidden_by_a_patched_comparison_is_seen_by_the_parent(tmp_path: Path) -> None:
    res = evaluate(tmp_path, hostile("mutate", forge="equal"))
    assert res.status == "rejected" and res.rule == rules.INPUT_MUTATION, res.message
    assert "input[0]" in res.message


# --- the op watch: ATen compute from anywhere in the candidate's process ----------------------


@pytest.mark.parametrize(("files", "fragments"), [
    (hostile("omp_aten"), ("on another thread", "aten::add")),  # the forward's guard sees its own thread
    (hostile("excluded_aten"), ("aten::add",)),  # ... and only the Python dispatch key
    (hostile("aten_when_timed"), ("aten::add", "during timing|during vouched batches")),
    (hostile(init="        self.cache = cuda_extension.warm(torch.ones(64, 64))"), ("during __init__", "aten::mm")),
], ids=["openmp-thread", "excluded-keys", "only-while-timed", "in-init"])
def test_aten_the_forward_guard_cannot_see_is_seen(tmp_path: Path, files: dict[str, str],
                                                  fragments: tuple[str, ...]) -> None:
    res = evaluate(tmp_path, files)
    assert res.status == "rejected" and res.rule == rules.TORCH_COMPUTE, res.message
    assert all(any(alt in res.message for alt in f.split("|")) for f in fragments), res.message
