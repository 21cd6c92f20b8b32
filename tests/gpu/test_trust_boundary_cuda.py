"""The trust boundary on a real GPU: a forged report, forged device times, work skipped when
timed, a wide softmax of zeros, and a GPU memory hog (the CPU tests: tests/evaluator/
test_trust_boundary.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from evaluator.test_trust_boundary import _STACK, FORGED_REPORT, FORGES, python_at_load

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules

from . import cases_cuda as C
from .test_evaluate_cuda import run
from .test_profile_cuda import prof

pytestmark = pytest.mark.gpu

# The profiler's device times of the candidate's calls, divided by 20 once attributed.
FORGED_DEVICE_TIME = python_at_load('''
import cuda_agent.evaluator.timing as T
_real = T._attribute_device_time
def _attribute(prof, tags, results):
    _real(prof, tags, results)
    m = results.get("candidate")
    if m is not None:
        m.device_us[:] = [x / 20 for x in m.device_us]
T._attribute_device_time = _attribute
''')
# The same, and the wall times with them: no gap between wall and device time gives it away.
FORGED_DEVICE_AND_WALL_TIME = FORGED_DEVICE_TIME.replace(
    "x / 20 for x in m.device_us]", "x / 20 for x in m.device_us]\n        m.wall_us[:] = [x / 20 for x in m.wall_us]")


def binding_with(helpers: str, body: str) -> dict[str, str]:
    files = dict(C.AXPBY)
    files["kernels/axpby_binding.cpp"] = (
        C.HEAD + C.LAUNCHER_DECL + helpers
        + f"static torch::Tensor axpby(torch::Tensor a, torch::Tensor b, double alpha) {{\n{body}\n}}\n"
        "static void register_axpby(pybind11::module& m) { m.def(\"axpby\", &axpby); }\n"
        "REGISTER_BINDING(axpby, register_axpby);\n")
    return files


STACK_SKIP = binding_with("#include <Python.h>\n#include <cstring>\n" + _STACK,
                          "  if (timed()) return torch::empty_like(a);\n  " + C.LAUNCH + "  return out;")

# Computes only for inputs seen in the trials (six floats of the first input, read back).
# (On the H100 with a torch copy for the read-back it was rejected as torch compute
# instead: not a win either way.)
FINGERPRINT_SKIP = binding_with('''
#include <array>
#include <set>
static std::set<std::array<float, 6>> seen;
static int calls = 0;
''', '''
  std::array<float, 6> fp{};  // (read with the CUDA runtime: a torch copy would be a compute op)
  cudaMemcpy(fp.data(), a.data_ptr<float>(), sizeof(fp), cudaMemcpyDeviceToHost);
  if (++calls <= ''' + str(C.TRIALS) + ''') seen.insert(fp);
  else if (!seen.count(fp)) return torch::empty_like(a);
''' + "  " + C.LAUNCH + "  return out;")

# Holds on to 1 GB of GPU memory more at every call.
GPU_HOG = binding_with("static std::vector<torch::Tensor> held;\n", '''
  for (int i = 0; i < 1000; ++i) held.push_back(torch::empty({int64_t(1) << 28}, a.options()));
''' + "  " + C.LAUNCH + "  return out;")


# ATen computes the answer on an OpenMP worker thread, or with the Python dispatch key excluded.
OMP_ATEN = binding_with("#include <omp.h>\n#include <ATen/ATen.h>\n", '''
  auto out = torch::empty_like(a);
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == 1) at::add_out(out, b, a, alpha);
  }
  return out;''')
EXCLUDED_ATEN = binding_with("#include <ATen/ATen.h>\n#include <c10/core/impl/LocalDispatchKeySet.h>\n", '''
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return at::add(b, a, alpha);''')


def not_won(res: R.EvalResult) -> None:
    if res.status == "ok":
        vouched = res.details["vouched"]
        assert R.FLAG_UNVOUCHED in res.flags, (res.message, vouched)
        assert res.speedup_vs_eager <= vouched["speedup_vs_eager"], vouched


def test_a_forged_report_and_an_early_exit_win_nothing_on_the_gpu(tmp_path: Path) -> None:
    files = {**C.AXPBY, "kernels/forge.cpp": FORGED_REPORT}
    res = prof(tmp_path, C.AXPBY_TASK, files, static_checks=False)
    assert res.status == "runtime_error" and res.rule == rules.VOUCHED and res.reward == -1.0, res.message


def test_forged_device_times_count_the_parents_time(tmp_path: Path) -> None:
    files = {**C.AXPBY, "kernels/forge.cpp": FORGED_DEVICE_TIME}
    res = prof(tmp_path, C.AXPBY_TASK, files, static_checks=False)
    print("  vouched:", res.details.get("vouched"))
    # (times that small are also faster than the memory can move the data: rejected for that)
    assert res.status == "ok" or res.rule == rules.BANDWIDTH, res.message
    inside = res.details["vouched"]["in_process"]["speedup_vs_eager"]
    not_won(res)
    assert res.reward < 3 and (res.status != "ok" or res.speedup_vs_eager < inside / 3), res.details["vouched"]


def test_forged_times_of_a_long_call_count_the_parents_floor(tmp_path: Path) -> None:
    """A millisecond of GEMM per call claims a twentieth of it, device and wall time alike,
    which the memory's bandwidth would allow: the parent's batches bound it."""
    task = C.linear_relu_large_task(tmp_path)
    files = {**C.LINEAR_RELU, "kernels/forge.cpp": FORGED_DEVICE_AND_WALL_TIME}
    res = prof(tmp_path / "run", task, files, static_checks=False)
    print("  vouched:", res.details.get("vouched"))
    assert res.status == "ok", res.message
    v = res.details["vouched"]
    assert v["in_process"]["speedup_vs_eager"] > 10, v  # what the forged times claimed
    not_won(res)
    assert res.speedup_vs_eager < 1.5 and res.reward < 3, v


def test_work_skipped_when_timed_fails_on_the_gpu(tmp_path: Path) -> None:
    for files in (STACK_SKIP, FINGERPRINT_SKIP):
        res = prof(tmp_path / str(len(files["kernels/axpby_binding.cpp"])), C.AXPBY_TASK, files,
                   static_checks=False)
        assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message


def test_zeros_for_a_wide_softmax_are_incorrect_on_the_gpu(tmp_path: Path) -> None:
    task = tmp_path / "wide_softmax.py"
    task.write_text(C.SOFTMAX_TASK.read_text().replace("dim = 4096", "dim = 32768"))
    zeros = C.SOFTMAX_SINGLE_FILE.replace("    return y;\n}", "    y.zero_();\n    return y;\n}", 1)
    assert zeros != C.SOFTMAX_SINGLE_FILE
    res = run(tmp_path / "zeros", task, {"model_new.py": zeros}, static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.RELATIVE_ERROR, res.message
    res = run(tmp_path / "real", task, {"model_new.py": C.SOFTMAX_SINGLE_FILE})
    assert res.status == "ok", res.message


def test_a_gpu_memory_hog_is_a_runtime_error_and_the_next_evaluation_works(tmp_path: Path) -> None:
    res = run(tmp_path / "hog", C.AXPBY_TASK, GPU_HOG, static_checks=False)
    assert res.status == "runtime_error" and "memory" in res.message.lower(), res.message
    res = run(tmp_path / "ok", C.AXPBY_TASK, C.AXPBY)
    assert res.status == "ok", res.message


def test_outputs_linked_to_the_expected_outputs_are_not_read_on_the_gpu(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, {**C.AXPBY, "kernels/forge.cpp": python_at_load(FORGES["links"])},
              static_checks=False)
    assert res.status == "runtime_error" and "symbolic link" in res.message, res.message


def test_aten_the_forward_guard_cannot_see_is_seen_on_the_gpu(tmp_path: Path) -> None:
    for tag, files in (("omp", OMP_ATEN), ("excluded", EXCLUDED_ATEN)):
        res = run(tmp_path / tag, C.AXPBY_TASK, files, static_checks=False)
        assert res.status == "rejected" and res.rule == rules.TORCH_COMPUTE and "aten::add" in res.message, \
            (tag, res.message)
