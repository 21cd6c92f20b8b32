"""Trials on other input distributions on a real GPU: a CUDA kernel that returns a constant,
or a formula of one input's mean, passes the task's own trials of a loss on `torch.rand`
inputs and fails a distribution trial; the exact kernel passes (the CPU tests:
tests/evaluator/test_distribution_trials.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from evaluator.test_distribution_trials import MSE_TASK, SEED

from cuda_agent.evaluator import distributions as D
from cuda_agent.evaluator import record as R

from . import cases_cuda as C
from .test_evaluate_cuda import run

pytestmark = pytest.mark.gpu

# `mse(p, t, mode)`: exact (0), the constant 1/6 (1), the expected loss of uniform inputs
# from the mean of `p` (2); one block reduces in double precision.
MSE_CUDA = {
    "kernels/mse.cu": r'''#include <cuda_runtime.h>
#include <cstdint>

__global__ void mse_kernel(float* out, const float* a, const float* b, int64_t n, int mode) {
  __shared__ double part[256];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n && mode != 1; i += blockDim.x) {
    const double d = mode == 2 ? static_cast<double>(a[i]) : static_cast<double>(a[i]) - b[i];
    s += mode == 2 ? d : d * d;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double m = part[0] / n;
    out[0] = static_cast<float>(mode == 1 ? 1.0 / 6.0 : mode == 2 ? 2.0 * m * m / 3.0 : m);
  }
}

extern "C" void mse_launcher(float* out, const float* a, const float* b, int64_t n, int mode, cudaStream_t s) {
  mse_kernel<<<1, 256, 0, s>>>(out, a, b, n, mode);
}
''',
    "kernels/mse_binding.cpp": C.HEAD + '''extern "C" void mse_launcher(float*, const float*, const float*, int64_t, int, cudaStream_t);
static torch::Tensor mse(torch::Tensor p, torch::Tensor t, int64_t mode) {
  TORCH_CHECK(p.is_cuda() && p.is_contiguous() && t.is_contiguous() && p.scalar_type() == torch::kFloat32, "mse");
  auto out = torch::empty({}, p.options());
  mse_launcher(out.data_ptr<float>(), p.data_ptr<float>(), t.data_ptr<float>(), p.numel(), (int)mode,
               c10::cuda::getCurrentCUDAStream());
  return out;
}
static void register_mse(pybind11::module& m) { m.def("mse", &mse); }
REGISTER_BINDING(mse, register_mse);
''',
}


def solution(mode: int) -> dict[str, str]:
    return {**MSE_CUDA, "model_new.py": (
        "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
        f"    def forward(self, predictions, targets):\n        return cuda_extension.mse(predictions, targets, {mode})\n")}


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["exact", "constant", "analytical"])
def test_loss_kernels_on_the_gpu_are_judged_on_other_distributions(tmp_path: Path, mode: int) -> None:
    task = tmp_path / "mse_loss.py"
    task.write_text(MSE_TASK)
    res = run(tmp_path, task, solution(mode), seed=SEED)
    print("  trials:", res.trial_inputs)
    if mode == 0:
        assert res.status == "ok" and res.trials_passed == 8, res.message
        assert R.FLAG_BARELY_VARIES in res.flags, res.flags
    else:
        assert res.status == "incorrect" and res.trials_passed >= 5, res.message
        assert any(f"inputs from the {d} distribution" in res.message for d in D.DISTRIBUTIONS), res.message
