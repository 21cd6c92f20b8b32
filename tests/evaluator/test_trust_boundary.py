"""Hostile solutions whose native code controls the candidate's process: a forged report,
a forged clock, work skipped when timed (found by the stack, by a fingerprint of inputs
seen before, by the gap since the last call), work left running after the call returns,
a patched comparison. None may win what it did not earn: the parent decides from its own
batches, timed by its own clock, and from outputs committed before it chose which to check.
"""

from __future__ import annotations

from pathlib import Path

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules

from . import cases as C
from .test_profile_cpu import prof


# Native code that runs when the extension is loaded, with the interpreter at its mercy.
def python_at_load(code: str) -> str:
    return ('#include <Python.h>\n\nnamespace {\nstruct Forge {\n  Forge() { PyRun_SimpleString(R"PY(\n'
            + code + '\n)PY"); }\n} forge;\n}  // namespace\n')


# Times the real work, then writes a report 20x faster and leaves before the parent's
# own batches.
FORGED_REPORT = python_at_load('''
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
''')

# The timing module's clock, replaced by one that runs 50 times slower while the candidate's
# own calls are timed (a clock slow for everything would slow the device probe beside
# them, and the speedups would shrink with it).
SLOW_CLOCK = python_at_load('''
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
''')

# Skips the work whenever a timing function is on the interpreter's stack.
STACK_SKIP = C.binding(C.CALL.replace("auto out", "if (timed()) return torch::empty_like(a);\n  auto out")
                       + "  return out;", extra='''
#include <Python.h>
#include <cstring>

static bool timed() {
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
''')

# Computes only for inputs it has seen in the trials (six floats of the first input).
FINGERPRINT_SKIP = C.binding('''
  const float* p = a.data_ptr<float>();
  std::array<float, 6> fp{p[0], p[1], p[2], p[3], p[4], p[5]};
  if (++calls <= 5) seen.insert(fp);
  else if (!seen.count(fp)) return torch::empty_like(a);
''' + C.CALL + "  return out;", extra='''
#include <array>
#include <set>
static std::set<std::array<float, 6>> seen;
static int calls = 0;
''')

# Computes only after a pause: calls back to back are timed ones.
CALL_GAP_SKIP = C.binding('''
  auto now = std::chrono::steady_clock::now();
  double gap = std::chrono::duration<double>(now - last).count();
  last = now;
  if (gap < 0.003) return torch::empty_like(a);
''' + C.CALL + "  return out;", extra='''
#include <chrono>
static auto last = std::chrono::steady_clock::now() - std::chrono::seconds(10);
''')

# Returns at once; a detached thread does the work a millisecond later.
DEFERRED_THREAD = C.binding('''
  auto out = torch::empty_like(a);
  std::thread([=]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());
  }).detach();
  return out;''', extra="#include <chrono>\n#include <thread>\n")

# The same through a Python thread the native code provides to model_new.py.
LATER = python_at_load('''
import builtins, threading, time
def later(fn, *args):
    def go():
        time.sleep(0.001)
        fn(*args)
    threading.Thread(target=go, daemon=True).start()
builtins.later = later
''')
INTO = C.binding(C.CALL.replace("auto out = torch::empty_like(a);\n", "") + "  return out;", name="axpby_into") \
    .replace("torch::Tensor a, torch::Tensor b, double alpha", "torch::Tensor out, torch::Tensor a, torch::Tensor b, "
             "double alpha")
PYTHON_THREAD = C.forward("out = torch.empty_like(a)\ncuda_extension.axpby_into(out[:1], a[:1], b[:1], self.alpha)\n"
                          "later(cuda_extension.axpby_into, out, a, b, self.alpha)\nreturn out")

# Zeroes its first input after computing, and makes every comparison say "equal".
MUTATE = C.binding(C.CALL + "  std::memset(a.data_ptr<float>(), 0, a.numel() * sizeof(float));\n  return out;",
                   extra="#include <cstring>\n")
EQUAL_ALWAYS = python_at_load('''
import torch
torch.equal = lambda *a, **k: True
torch.Tensor.__eq__ = lambda self, other: torch.ones(self.shape, dtype=torch.bool)
''')


def not_won(res: R.EvalResult) -> None:
    """Either the verdict is against it, or the speedups counted are the parent's own."""
    if res.status == "ok":
        vouched = res.details["vouched"]
        assert R.FLAG_UNVOUCHED in res.flags, (res.message, vouched)
        assert res.speedup_vs_eager == vouched["speedup_vs_eager"], vouched
        assert res.speedup_vs_compile == vouched["speedup_vs_compile"], vouched


def test_a_forged_report_and_an_early_exit_win_nothing(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(forge__cpp=FORGED_REPORT), static_checks=False)
    assert res.status == "runtime_error" and res.reward == -1.0 and res.rule == rules.VOUCHED, res.message
    assert "ended before its timed batches" in res.message


def test_a_forged_clock_counts_the_parents_time(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(forge__cpp=SLOW_CLOCK), static_checks=False)
    assert res.status == "ok", res.message
    inside = res.details["vouched"]["in_process"]["speedup_vs_eager"]
    assert inside > 10, res.details["vouched"]  # what the forged clock claimed
    not_won(res)
    assert res.speedup_vs_eager < inside / 3


def test_work_skipped_when_a_timing_function_is_on_the_stack_fails(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(axpby_binding__cpp=STACK_SKIP), static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message
    assert "batch" in res.message


def test_computing_only_for_inputs_seen_before_fails(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(axpby_binding__cpp=FINGERPRINT_SKIP), static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message


def test_computing_only_after_a_pause_wins_nothing(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(axpby_binding__cpp=CALL_GAP_SKIP), static_checks=False)
    not_won(res)


def test_work_left_to_a_native_thread_fails(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(axpby_binding__cpp=DEFERRED_THREAD), static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT or \
        res.status == "incorrect" and "trial" in res.message, res.message


def test_work_left_to_a_python_thread_fails(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(PYTHON_THREAD, axpby_binding__cpp=INTO, forge__cpp=LATER), static_checks=False)
    assert res.status == "incorrect", res.message


def test_a_mutation_hidden_by_a_patched_comparison_is_seen_by_the_parent(tmp_path: Path) -> None:
    res = prof(tmp_path, C.axpby(axpby_binding__cpp=MUTATE, forge__cpp=EQUAL_ALWAYS), static_checks=False)
    assert res.status == "rejected" and res.rule == rules.INPUT_MUTATION, res.message
    assert "input[0]" in res.message
