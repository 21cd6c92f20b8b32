"""CUDA solutions for the GPU tests: correct kernels of KernelBench shape and cheat patterns."""

from __future__ import annotations

from pathlib import Path

from evaluator.cases import TRIALS  # noqa: F401  (the GPU tests' cheats count calls by it)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TASKS = REPO / "tests" / "tasks" / "data"
AXPBY_TASK = EXAMPLES / "tasks" / "axpby.py"
AXPBY_DIR = EXAMPLES / "solutions" / "axpby_cuda"
AXPBY = {
    "model_new.py": (AXPBY_DIR / "model_new.py").read_text(),
    **{f"kernels/{p.name}": p.read_text() for p in sorted((AXPBY_DIR / "kernels").iterdir())},
}

HEAD = """#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <chrono>
#include <vector>

#include "../binding_registry.h"
"""

# A binding for axpby whose body is replaced by each cheat; the .cu launcher stays the example's.
LAUNCHER_DECL = 'extern "C" void axpby_launcher(float*, const float*, const float*, float, int64_t, cudaStream_t);\n'


def axpby_binding(body: str) -> dict[str, str]:
    files = dict(AXPBY)
    files["kernels/axpby_binding.cpp"] = (
        HEAD + LAUNCHER_DECL
        + f"static torch::Tensor axpby(torch::Tensor a, torch::Tensor b, double alpha) {{\n{body}\n}}\n"
        "static void register_axpby(pybind11::module& m) { m.def(\"axpby\", &axpby); }\n"
        "REGISTER_BINDING(axpby, register_axpby);\n"
    )
    return files


CUR = "c10::cuda::getCurrentCUDAStream().stream()"
LAUNCH = f"auto out = torch::empty_like(a);\n  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel(), {CUR});\n"

CHEATS = {
    # never launches a kernel: returns whatever memory it was given
    "uninitialised": (axpby_binding("auto out = torch::empty_like(a);\n  return out;"), "incorrect", None),
    # right answer, then zeroes its input
    "input-zeroing": (axpby_binding(LAUNCH + f"  cudaMemsetAsync(a.data_ptr<float>(), 0, a.numel() * 4, {CUR});\n  return out;"),
                      "rejected", "input-mutation"),
    # right answer computed on a private stream the caller never waits for
    "side-stream": (axpby_binding(
        "static cudaStream_t side = nullptr;\n  if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
        "  auto out = torch::empty_like(a);\n"
        "  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel(), side);\n"
        "  return out;"), "rejected", "non-current-stream"),
    # torch ops in the C++ binding
    "torch-op-in-binding": (axpby_binding("return a.mul(alpha).add(b);"), "rejected", "torch-compute-op"),
}

F_FALLBACK = dict(AXPBY)
F_FALLBACK["model_new.py"] = (
    "import torch.nn as nn\nimport torch.nn.functional as F\n\nimport cuda_extension\n\n\n"
    "class ModelNew(nn.Module):\n    def __init__(self, alpha):\n        super().__init__()\n        self.alpha = alpha\n\n"
    "    def forward(self, a, b):\n        return F.hardtanh(cuda_extension.axpby(a, b, self.alpha), -1e9, 1e9)\n"
)

RELU_TASK = TASKS / "19_ReLU.py"
RELU = {
    "model_new.py": (
        "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
        "    def forward(self, x):\n        return cuda_extension.relu(x)\n"
    ),
    "kernels/relu.cu": (
        "#include <cuda_runtime.h>\n#include <cstdint>\n"
        "__global__ void relu_kernel(float* out, const float* x, int64_t n) {\n"
        "  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)\n"
        "    out[i] = fmaxf(x[i], 0.f);\n}\n"
        "extern \"C\" void relu_launcher(float* out, const float* x, int64_t n, cudaStream_t s) {\n"
        "  int64_t blocks = (n + 255) / 256; if (blocks > 4096) blocks = 4096;\n"
        "  if (n > 0) relu_kernel<<<blocks, 256, 0, s>>>(out, x, n);\n}\n"
    ),
    "kernels/relu_binding.cpp": (
        HEAD + "extern \"C\" void relu_launcher(float*, const float*, int64_t, cudaStream_t);\n"
        "static torch::Tensor relu(torch::Tensor x) {\n"
        "  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == torch::kFloat32, \"relu: contiguous float32 CUDA\");\n"
        f"  auto out = torch::empty_like(x);\n  relu_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel(), {CUR});\n  return out;\n}}\n"
        "static void register_relu(pybind11::module& m) { m.def(\"relu\", &relu); }\n"
        "REGISTER_BINDING(relu, register_relu);\n"
    ),
}

LINEAR_RELU_TASK = TASKS / "76_Linear_ReLU.py"
# GEMM through cuBLAS (allowed), bias + ReLU fused in a custom kernel.
LINEAR_RELU = {
    "model_new.py": (
        "import torch\nimport torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n    def __init__(self, in_features, out_features):\n        super().__init__()\n"
        "        self.linear = nn.Linear(in_features, out_features)\n\n"
        "    def forward(self, x):\n        return cuda_extension.linear_relu(x, self.linear.weight, self.linear.bias)\n"
    ),
    "kernels/bias_relu.cu": (
        "#include <cuda_runtime.h>\n#include <cstdint>\n"
        "__global__ void bias_relu_kernel(float* y, const float* b, int64_t rows, int64_t cols) {\n"
        "  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
        "  if (i < rows * cols) { float v = y[i] + b[i % cols]; y[i] = v > 0.f ? v : 0.f; }\n}\n"
        "extern \"C\" void bias_relu_launcher(float* y, const float* b, int64_t rows, int64_t cols, cudaStream_t s) {\n"
        "  int64_t n = rows * cols; if (n > 0) bias_relu_kernel<<<(n + 255) / 256, 256, 0, s>>>(y, b, rows, cols);\n}\n"
    ),
    "kernels/linear_relu_binding.cpp": (
        HEAD + "#include <ATen/cuda/CUDAContext.h>\n#include <cublas_v2.h>\n"
        "extern \"C\" void bias_relu_launcher(float*, const float*, int64_t, int64_t, cudaStream_t);\n"
        "static torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {\n"
        "  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), \"linear_relu: shapes\");\n"
        "  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && b.is_contiguous(), \"linear_relu: contiguous\");\n"
        "  const int64_t n = x.size(0), k = x.size(1), m = w.size(0);\n"
        "  auto y = torch::empty({n, m}, x.options());\n"
        "  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();\n"
        f"  cublasSetStream(h, {CUR});\n"
        "  const float one = 1.f, zero = 0.f;\n"
        "  // y^T (m x n, column-major) = W (m x k) * x^T (k x n): row-major y = x W^T.\n"
        "  cublasStatus_t st = cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, (int)n, (int)k, &one,\n"
        "      w.data_ptr<float>(), (int)k, x.data_ptr<float>(), (int)k, &zero, y.data_ptr<float>(), (int)m);\n"
        "  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, \"cublasSgemm failed\");\n"
        f"  bias_relu_launcher(y.data_ptr<float>(), b.data_ptr<float>(), n, m, {CUR});\n  return y;\n}}\n"
        "static void register_linear_relu(pybind11::module& m) { m.def(\"linear_relu\", &linear_relu); }\n"
        "REGISTER_BINDING(linear_relu, register_linear_relu);\n"
    ),
}

def linear_relu_large_task(folder: Path) -> Path:
    """76_Linear_ReLU at 2048 x 4096 -> 4096: about a millisecond of GEMM per call on an
    H100, long beside its launch, and compute-bound (its traffic is far under what the
    memory moves in that time)."""
    text = LINEAR_RELU_TASK.read_text()
    for old, new in (("batch_size = 32", "batch_size = 2048"), ("in_features = 256", "in_features = 4096"),
                     ("out_features = 128", "out_features = 4096")):
        assert old in text
        text = text.replace(old, new)
    path = folder / "linear_relu_large.py"
    path.write_text(text)
    return path


SOFTMAX_TASK = TASKS / "23_Softmax.py"
# KernelBench single-file format: one block per row, shared-memory reductions.
SOFTMAX_SINGLE_FILE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = """
#include <c10/cuda/CUDAStream.h>
__global__ void softmax_rows(const float* x, float* y, int cols) {
    extern __shared__ float red[];
    const float* xr = x + (long)blockIdx.x * cols;
    float* yr = y + (long)blockIdx.x * cols;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, xr[c]);
    red[threadIdx.x] = m; __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]); __syncthreads(); }
    m = red[0]; __syncthreads();
    float sum = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += __expf(xr[c] - m);
    red[threadIdx.x] = sum; __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s]; __syncthreads(); }
    float inv = 1.f / red[0];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = __expf(xr[c] - m) * inv;
}
torch::Tensor softmax_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "2-D contiguous CUDA input");
    auto y = torch::empty_like(x);
    softmax_rows<<<x.size(0), 256, 256 * sizeof(float), c10::cuda::getCurrentCUDAStream().stream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), (int)x.size(1));
    return y;
}
"""
cpp_src = "torch::Tensor softmax_cuda(torch::Tensor x);"

softmax = load_inline(name="softmax_rows_ext", cpp_sources=cpp_src, cuda_sources=cuda_src,
                      functions=["softmax_cuda"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return softmax.softmax_cuda(x)
'''

# --- profiling -----------------------------------------------------------------------------

CHAIN_TASK = TASKS / "Elementwise_Chain.py"


def chain(passes: int) -> dict[str, str]:
    """The elementwise-chain task in `passes` passes over memory (eager: twelve, compile: one)."""
    assert 6 % passes == 0
    return {
        "model_new.py": (
            "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
            "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
            "    def forward(self, x):\n"
            f"        for _ in range({passes}):\n            x = cuda_extension.chain(x, {6 // passes})\n"
            "        return x\n"
        ),
        "kernels/chain.cu": (
            "#include <cuda_runtime.h>\n#include <cstdint>\n"
            "__global__ void chain_kernel(float* out, const float* x, int64_t n, int steps) {\n"
            "  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {\n"
            "    float v = x[i];\n    for (int s = 0; s < steps; ++s) v = v * 0.9f + 0.1f;\n    out[i] = v;\n  }\n}\n"
            "extern \"C\" void chain_launcher(float* out, const float* x, int64_t n, int steps, cudaStream_t s) {\n"
            "  int64_t blocks = (n + 255) / 256; if (blocks > 8192) blocks = 8192;\n"
            "  if (n > 0) chain_kernel<<<blocks, 256, 0, s>>>(out, x, n, steps);\n}\n"
        ),
        "kernels/chain_binding.cpp": (
            HEAD + "extern \"C\" void chain_launcher(float*, const float*, int64_t, int, cudaStream_t);\n"
            "static torch::Tensor chain(torch::Tensor x, int64_t steps) {\n"
            "  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == torch::kFloat32, \"chain: contiguous float32 CUDA\");\n"
            f"  auto out = torch::empty_like(x);\n  chain_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel(), (int)steps, {CUR});\n"
            "  return out;\n}\n"
            "static void register_chain(pybind11::module& m) { m.def(\"chain\", &chain); }\n"
            "REGISTER_BINDING(chain, register_chain);\n"
        ),
    }


# Verification sees the honest kernel (the first five calls); later calls escape to a side
# stream that the caller never waits for. Device time counts every stream, and the timing
# sees the foreign stream.
LATE_SIDE_STREAM = axpby_binding(
    "static int calls = 0;\n  static cudaStream_t side = nullptr;\n"
    "  if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
    "  auto out = torch::empty_like(a);\n"
    f"  cudaStream_t s = ++calls > {TRIALS} ? side : {CUR};\n"
    "  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel(), s);\n"
    "  return out;")

# The right answer computed on the host: the copies are all the GPU sees.
HOST_COMPUTE = axpby_binding(
    "auto out = torch::empty_like(a);\n  const int64_t n = a.numel();\n"
    "  std::vector<float> ha(n), hb(n);\n"
    f"  cudaMemcpyAsync(ha.data(), a.data_ptr<float>(), n * 4, cudaMemcpyDeviceToHost, {CUR});\n"
    f"  cudaMemcpyAsync(hb.data(), b.data_ptr<float>(), n * 4, cudaMemcpyDeviceToHost, {CUR});\n"
    f"  cudaStreamSynchronize({CUR});\n"
    "  for (int64_t i = 0; i < n; ++i) ha[i] = (float)alpha * ha[i] + hb[i];\n"
    "  // more host work, as a bigger computation would need\n"
    "  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);\n"
    "  while (std::chrono::steady_clock::now() < until) {}\n"
    f"  cudaMemcpyAsync(out.data_ptr<float>(), ha.data(), n * 4, cudaMemcpyHostToDevice, {CUR});\n"
    f"  cudaStreamSynchronize({CUR});\n  return out;")
