"""Static checks: honest solutions pass, each rule break is named with its line."""

from __future__ import annotations

import textwrap

import pytest

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.static_checks import (
    Violation,
    check_cpp_source,
    check_model_new,
    check_solution,
    extract_inline_sources,
)


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _rules(violations: list[Violation]) -> set[str]:
    return {v.rule for v in violations}


def _line_of(source: str, needle: str) -> int:
    for number, line in enumerate(source.splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in source")


# ----------------------------------------------------------------------------------------
# Honest solutions pass
# ----------------------------------------------------------------------------------------

WORKSPACE_MODEL_NEW = _src(
    '''
    """Faster version of the model in model.py: one fused GEMM + bias + ReLU kernel."""
    import math

    import torch
    import torch.nn as nn

    import cuda_extension


    class ModelNew(nn.Module):
        def __init__(self, in_features: int, out_features: int, bias_shape=(1,)) -> None:
            super().__init__()
            self.linear = nn.Linear(in_features, out_features)
            self.bias = nn.Parameter(torch.randn(bias_shape) * 0.02)
            nn.init.kaiming_uniform_(self.linear.weight, a=math.sqrt(5))
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)).view(1, 1, 4, 4))
            self.scale = 1.0 / math.sqrt(out_features)

        @torch.no_grad()
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            n, k = x.shape
            m = self.linear.weight.size(0)
            out = torch.empty((n, m), device=x.device, dtype=x.dtype)
            if x.dim() != 2 or x.size(0) * 2 < 0 or x is None:
                raise ValueError("expected a 2-D input")
            assert x.is_cuda and x.dtype == torch.float32
            dims = [n, m]
            dims.sort()
            blocks = (x.numel() + 255) // 256
            stream = torch.cuda.current_stream().cuda_stream
            cuda_extension.gemm_bias_relu(
                x, self.linear.weight, self.linear.bias, out, self.scale, blocks, stream
            )
            return out.view(n, m)
    '''
)

AUTOGRAD_MODEL_NEW = _src(
    """
    import torch
    import torch.nn as nn
    import cuda_extension


    class _Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            ctx.scale = 2.0
            return cuda_extension.fused_forward(x, w)

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad @ w, grad.t() @ x


    class ModelNew(nn.Module):
        def __init__(self, n: int):
            super(ModelNew, self).__init__()
            self.w = nn.Parameter(torch.empty(n, n))
            self.w.data.normal_()
            self.net = nn.Sequential(nn.Linear(n, n), nn.ReLU())

        def forward(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
            first = self.net[0].weight
            return _Fused.apply(x, self.w)
    """
)

HELPER_MODEL_NEW = _src(
    """
    import functools
    import math
    from typing import Optional

    import torch
    from torch import nn
    from cuda_extension import fused as fused_op


    def _launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        return fused_op(x, w, (n + 255) // 256)


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = _launch

        def forward(self, x):
            return self.op(x, x)


    class ModelNew(nn.Module):
        def __init__(self, layers: int = 2):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(layers)])
            self.block = Block()
            self.eps = 1e-5

        def forward(self, A: torch.Tensor, s: float, bias: Optional[torch.Tensor] = None):
            b, c = A.shape[0], A.shape[1]
            total = math.prod(A.shape) * 2
            elems = functools.reduce(lambda p, q: p * q, A.shape, 1)
            factor = s * 2.0
            for i in range(len(self.layers)):
                A = _launch(A, self.layers[i].weight)
            y = A.view(b, -1).permute(1, 0).contiguous().to(torch.float16)
            if y.dim() == 2 and y.size(1) > 16 and min(y.size(1), 1024) > abs(self.eps):
                y = y.float()
            shape = (y.size(0), y.size(1) // 2)
            params = sum(p.numel() for p in self.parameters())
            seen = set()
            seen.add(b)
            return self.block(y.reshape(shape[0], -1))


    if __name__ == "__main__":
        from_inputs = ModelNew()
    """
)

SINGLE_FILE_MODEL_NEW = _src(
    '''
    import os
    import torch
    import torch.nn as nn
    from torch.utils.cpp_extension import load_inline

    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"

    elementwise_add_source = """
    #include <torch/extension.h>
    #include <cuda_runtime.h>

    __global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {
        int idx = blockIdx.x * blockDim.x + threadIdx.x;
        if (idx < size) {
            out[idx] = a[idx] + b[idx];
        }
    }

    torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
        auto size = a.numel();
        auto out = torch::zeros_like(a);
        const int block_size = 256;
        const int num_blocks = (size + block_size - 1) / block_size;
        elementwise_add_kernel<<<num_blocks, block_size>>>(
            a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), size);
        return out;
    }
    """

    elementwise_add_cpp_source = (
        "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"
    )

    elementwise_add = load_inline(
        name="elementwise_add",
        cpp_sources=elementwise_add_cpp_source,
        cuda_sources=elementwise_add_source,
        functions=["elementwise_add_cuda"],
        verbose=True,
        extra_cflags=["-O3"],
        extra_ldflags=["-lcublas"],
    )


    class ModelNew(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.elementwise_add = elementwise_add

        def forward(self, a, b):
            return self.elementwise_add.elementwise_add_cuda(a, b)
    '''
)

LAZY_SINGLE_FILE = _src(
    '''
    import torch
    import torch.nn as nn
    import torch.utils.cpp_extension

    CPP = "torch::Tensor f(torch::Tensor x);"
    CUDA = """
    #include <torch/extension.h>
    torch::Tensor f(torch::Tensor x) { return torch::empty_like(x); }
    """


    def _build():
        return torch.utils.cpp_extension.load_inline(
            "f_ext", [CPP], cuda_sources=[CUDA], functions=["f"]
        )


    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.ext = _build()

        def forward(self, x):
            return self.ext.f(x)
    '''
)

GEMM_CU = _src(
    """
    // Tiled GEMM with fused bias + ReLU; torch::matmul would be slower.
    #include <cuda_runtime.h>
    #include <cuda_fp16.h>
    #include <cuda_bf16.h>
    #include <mma.h>
    #include <cooperative_groups.h>
    #include <cub/block/block_reduce.cuh>
    #include <thrust/device_vector.h>
    #include <cuda/std/cstdint>
    #include <cublas_v2.h>
    #include <cublasLt.h>
    #include <cudnn.h>
    #include <cstdint>
    #include <algorithm>
    #include "common.cuh"

    namespace cg = cooperative_groups;

    /* at::mm( in a block comment
       spanning lines */
    template <int TILE>
    __global__ void gemm_bias_relu_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                          const float* __restrict__ bias, float* __restrict__ c,
                                          int m, int n, int k) {
        __shared__ float as[TILE][TILE];
        __shared__ float bs[TILE][TILE];
        int row = blockIdx.y * TILE + threadIdx.y;
        int col = blockIdx.x * TILE + threadIdx.x;
        float acc = 0.f;
        for (int t = 0; t < (k + TILE - 1) / TILE; ++t) {
            as[threadIdx.y][threadIdx.x] = a[row * k + t * TILE + threadIdx.x];
            bs[threadIdx.y][threadIdx.x] = b[(t * TILE + threadIdx.y) * n + col];
            __syncthreads();
            #pragma unroll
            for (int i = 0; i < TILE; ++i) acc += as[threadIdx.y][i] * bs[i][threadIdx.x];
            __syncthreads();
        }
        auto block = cg::this_thread_block();
        block.sync();
        const char* msg = "torch::relu( in a string";
        const char* raw = R"x(std::thread t; x.sum())x";
        int big = 1'000'000;
        char q = '"';
        (void)msg; (void)raw; (void)big; (void)q;
        c[row * n + col] = fmaxf(acc + bias[col], 0.f);
    }

    extern "C" void gemm_bias_relu_launcher(const float* a, const float* b, const float* bias,
                                            float* c, int m, int n, int k, cudaStream_t stream) {
        dim3 block(16, 16);
        dim3 grid((n + 15) / 16, (m + 15) / 16);
        gemm_bias_relu_kernel<16><<<grid, block, 0, stream>>>(a, b, bias, c, m, n, k);
    }

    void cublas_path(cublasHandle_t h, const float* a, const float* b, float* c, int m, int n,
                     int k) {
        const float alpha = 1.f, beta = 0.f;
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha, b, n, a, k, &beta, c, n);
        float x = std::max(1.0f, 2.0f);
        (void)x;
    }
    """
)

GEMM_BINDING = _src(
    """
    #include <torch/extension.h>
    #include <ATen/cuda/CUDAContext.h>
    #include <c10/cuda/CUDAGuard.h>
    #include "../binding_registry.h"

    extern "C" void gemm_bias_relu_launcher(const float*, const float*, const float*, float*,
                                            int, int, int, cudaStream_t);

    torch::Tensor gemm_bias_relu(torch::Tensor a, torch::Tensor w, torch::Tensor bias) {
        TORCH_CHECK(a.is_cuda(), "a must be a CUDA tensor");
        TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "a must be 2-D and contiguous");
        TORCH_CHECK(a.scalar_type() == at::kFloat, "float32 only");
        const at::cuda::OptionalCUDAGuard guard(device_of(a));
        auto wt = w.t().contiguous();
        auto out = torch::empty({a.size(0), w.size(0)}, a.options());
        auto stream = at::cuda::getCurrentCUDAStream();
        cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
        (void)handle;
        AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "gemm", [&] {
            gemm_bias_relu_launcher(a.data_ptr<float>(), wt.data_ptr<float>(),
                                    bias.data_ptr<float>(), out.data_ptr<float>(), a.size(0),
                                    w.size(0), a.size(1), stream);
        });
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
        auto tmp = torch::zeros({1}, opts);
        at::ScalarType st = at::ScalarType::Float;
        (void)st; (void)tmp;
        c10::cuda::CUDAStreamGuard sg(stream);
        return out;
    }

    REGISTER_BINDING(gemm_bias_relu, gemm_bias_relu);
    """
)

RELU_CPU = _src(
    """
    #include <torch/extension.h>
    #include <ATen/Parallel.h>
    #include <omp.h>
    #include <immintrin.h>
    #include <vector>
    #include "../binding_registry.h"

    torch::Tensor relu_cpu(torch::Tensor x) {
        auto out = torch::empty_like(x);
        const float* in = x.data_ptr<float>();
        float* o = out.data_ptr<float>();
        int64_t n = x.numel();
        #pragma omp parallel for
        for (int64_t i = 0; i < n; ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
        at::parallel_for(0, n, 2048, [&](int64_t b, int64_t e) {
            for (auto i = b; i < e; ++i) o[i] = o[i];
        });
        return out;
    }

    REGISTER_BINDING(relu_cpu, relu_cpu);
    """
)


@pytest.mark.parametrize(
    "source",
    [WORKSPACE_MODEL_NEW, AUTOGRAD_MODEL_NEW, HELPER_MODEL_NEW],
    ids=["fused-gemm", "autograd-function", "helpers-and-submodules"],
)
def test_honest_workspace_model_new_passes(source: str) -> None:
    assert check_model_new(source) == []


@pytest.mark.parametrize(
    "source", [SINGLE_FILE_MODEL_NEW, LAZY_SINGLE_FILE], ids=["kernelbench", "lazy-build"]
)
def test_honest_single_file_solution_passes(source: str) -> None:
    assert check_solution({"model_new.py": source}, device="cuda", single_file=True) == []


def test_honest_cuda_workspace_passes() -> None:
    files = {
        "model_new.py": WORKSPACE_MODEL_NEW,
        "kernels/gemm.cu": GEMM_CU,
        "kernels/common.cuh": "#pragma once\n#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))\n",
        "kernels/gemm_binding.cpp": GEMM_BINDING,
        "notes.md": "torch::matmul is what we replace",
    }
    assert check_solution(files, device="cuda", single_file=False) == []


def test_honest_cpu_workspace_passes() -> None:
    files = {"model_new.py": WORKSPACE_MODEL_NEW, "kernels/relu.cpp": RELU_CPU}
    assert check_solution(files, device="cpu", single_file=False) == []


# ----------------------------------------------------------------------------------------
# Python rules
# ----------------------------------------------------------------------------------------

FORWARD_TEMPLATE = """\
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.act = nn.ReLU()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x, y):
        out = cuda_extension.op(x, y)
        {body}
        return out
"""


@pytest.mark.parametrize(
    ("body", "rule", "fragment"),
    [
        ("out = torch.matmul(x, y)", rules.TORCH_COMPUTE, "torch.matmul"),
        ("out = torch.relu(out)", rules.TORCH_COMPUTE, "torch.relu"),
        ("out = torch.softmax(out, dim=-1)", rules.TORCH_COMPUTE, "torch.softmax"),
        ("out = torch.Tensor.add(out, y)", rules.TORCH_COMPUTE, "torch.Tensor.add"),
        ("out = out.sum(dim=1)", rules.TORCH_COMPUTE, ".sum()"),
        ("out.add_(y)", rules.TORCH_COMPUTE, ".add_()"),
        ("out = out.view(-1).exp()", rules.TORCH_COMPUTE, ".exp()"),
        ("out = x @ y", rules.TORCH_COMPUTE, "x @ y"),
        ("out = out + self.w", rules.TORCH_COMPUTE, "out + self.w"),
        ("out = out * 2", rules.TORCH_COMPUTE, "out * 2"),
        ("out = x.view(-1) - 1", rules.TORCH_COMPUTE, "x.view(-1) - 1"),
        ("out = out * self.conv.weight.sum()", rules.TORCH_COMPUTE, ".sum()"),
        ("out += y", rules.TORCH_COMPUTE, "out += y"),
        ("out = -out", rules.TORCH_COMPUTE, "-out"),
        ("mask = out > 0", rules.TORCH_COMPUTE, "out > 0"),
        ("out = abs(out)", rules.TORCH_COMPUTE, "abs(out)"),
        ("out = self.conv(x)", rules.TORCH_COMPUTE, "torch.nn.Conv2d"),
        ("out = self.act.forward(out)", rules.TORCH_COMPUTE, "torch.nn.ReLU"),
        ("act = self.act\n        out = act(out)", rules.TORCH_COMPUTE, "torch.nn.ReLU"),
        ("out = nn.ReLU()(out)", rules.TORCH_COMPUTE, "torch.nn module"),
        ("out = torch.compile(lambda t: t)(x)", rules.TORCH_COMPUTE, "compiler"),
        ("out = getattr(torch, 'mm')(x, y)", rules.TORCH_COMPUTE, "torch.mm"),
        ("out = torch.nn.functional.relu(out)", rules.FUNCTIONAL, "torch.nn.functional.relu"),
        ("out = eval('x')", rules.INTROSPECTION, "eval"),
        ("f = getattr(out, self.name)", rules.INTROSPECTION, "getattr"),
        ("setattr(self, 'a', 1)", rules.INTROSPECTION, "setattr"),
        ("g = globals()", rules.INTROSPECTION, "globals"),
        ("torch.matmul = cuda_extension.op", rules.INTROSPECTION, "monkey-patches"),
        ("cuda_extension.op = None", rules.INTROSPECTION, "monkey-patches"),
        ("nn.Module.__call__ = None", rules.INTROSPECTION, "__call__"),
        ("out = torch.ops.aten.mm(x, y)", rules.INTROSPECTION, "torch.ops.aten.mm"),
        ("out = torch._C._nn.linear(x, y)", rules.INTROSPECTION, "private"),
        ("d = out.__class__", rules.INTROSPECTION, "__class__"),
        ("d = self.conv._parameters", rules.INTROSPECTION, "private"),
        ("text = open('weights.txt').read()", rules.INTROSPECTION, "open"),
        ("path = 'model.py'", rules.REFERENCE_FALLBACK, "model.py"),
        ("out = Model()(x)", rules.REFERENCE_FALLBACK, "Model"),
        ("inputs = get_inputs()", rules.REFERENCE_FALLBACK, "get_inputs"),
        ("args = get_init_inputs()", rules.REFERENCE_FALLBACK, "get_init_inputs"),
    ],
)
def test_forward_rule_breaks_are_named_with_their_line(body: str, rule: str, fragment: str) -> None:
    source = FORWARD_TEMPLATE.format(body=body)
    violations = check_model_new(source)
    hits = [v for v in violations if v.rule == rule]
    assert hits, violations
    first_line = body.splitlines()[-1].strip()
    assert any(v.line == _line_of(source, first_line) for v in hits), hits
    assert any(fragment in v.message for v in hits), hits


@pytest.mark.parametrize(
    "body",
    [
        "n = x.size(0) * 2 + 1",
        "half = x.shape[-1] // 2",
        "ok = x.dim() == 4 and x.dtype == torch.float16 and x is not None",
        "b = max(x.size(0), 1)",
        "parts = [t.contiguous() for t in (x, y)]",
        "buf = torch.empty_like(x)",
        "buf = x.new_empty((x.size(0), 4))",
        "v = x.view(-1).float().to(torch.float16).permute(0).contiguous()",
        "z = torch.zeros(x.size(0), device=x.device)",
        "names = ['a']\n        names.sort()",
        "import math\n        e = math.exp(1.0)",
        "out = cuda_extension.add(out, y)",
        "out = (lambda input: cuda_extension.op(input, y))(x)",
        "out = cuda_extension.op(out.view(-1), self.w)",
        "w = self.conv.weight\n        out = cuda_extension.conv(x, w, self.conv.bias)",
    ],
)
def test_plain_python_around_tensors_is_not_compute(body: str) -> None:
    source = FORWARD_TEMPLATE.format(body=body)
    assert check_model_new(source) == []


@pytest.mark.parametrize(
    ("line", "rule", "single_file"),
    [
        ("import os", rules.FORBIDDEN_IMPORT, False),
        ("import sys", rules.FORBIDDEN_IMPORT, False),
        ("import numpy as np", rules.FORBIDDEN_IMPORT, False),
        ("import subprocess", rules.FORBIDDEN_IMPORT, False),
        ("import ctypes", rules.FORBIDDEN_IMPORT, False),
        ("import importlib", rules.FORBIDDEN_IMPORT, False),
        ("import triton", rules.FORBIDDEN_IMPORT, False),
        ("from cuda_agent.evaluator import static_checks", rules.FORBIDDEN_IMPORT, False),
        ("from torch import *", rules.FORBIDDEN_IMPORT, False),
        ("import cuda_extension as ce", rules.FORBIDDEN_IMPORT, True),
        ("import threading", rules.THREADS, False),
        ("from concurrent.futures import ThreadPoolExecutor", rules.THREADS, False),
        ("import torch.multiprocessing as mp", rules.THREADS, False),
        ("import torch.nn.functional as F", rules.FUNCTIONAL, False),
        ("from torch.nn import functional as F", rules.FUNCTIONAL, False),
        ("from torch.nn.functional import relu", rules.FUNCTIONAL, False),
        ("from torch import matmul", rules.TORCH_COMPUTE, False),
        ("from model import Model", rules.REFERENCE_FALLBACK, False),
        ("import model", rules.REFERENCE_FALLBACK, False),
        ("from .model import Model", rules.REFERENCE_FALLBACK, False),
        ("from torch.utils.cpp_extension import load_inline", rules.INTROSPECTION, False),
        ("from torch.utils.cpp_extension import load", rules.INTROSPECTION, True),
        ("import torch._dynamo", rules.INTROSPECTION, False),
        ("import torch.library", rules.INTROSPECTION, False),
    ],
)
def test_imports(line: str, rule: str, single_file: bool) -> None:
    source = FORWARD_TEMPLATE.replace("import cuda_extension\n", f"import cuda_extension\n{line}\n")
    violations = check_model_new(source, single_file=single_file)
    assert any(v.rule == rule and v.line == 4 for v in violations), violations


def test_allowed_imports_pass() -> None:
    header = _src(
        """
        from __future__ import annotations
        import math
        import functools
        import dataclasses
        import collections
        from typing import Optional
        import torch
        import torch.nn as nn
        from torch import Tensor, nn as torch_nn
        from torch.nn import Parameter, init
        from torch.autograd import Function
        """
    )
    source = header + FORWARD_TEMPLATE.format(body="pass")
    assert check_model_new(source) == []


def test_os_in_single_file_only_for_environment() -> None:
    base = LAZY_SINGLE_FILE.replace("import torch\n", "import os\nimport torch\n", 1)
    ok = base + '\nos.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")\n'
    ok += 'os.environ["MAX_JOBS"] = os.getenv("MAX_JOBS", "4")\nhere = os.path.dirname("x")\n'
    assert check_model_new(ok, single_file=True) == []
    bad = base + '\nos.system("nvidia-smi")\npid = os.fork()\n'
    violations = check_model_new(bad, single_file=True)
    system_line = _line_of(bad, "os.system")
    assert [(v.rule, "os.system" in v.message) for v in violations if v.line == system_line] == [
        (rules.FORBIDDEN_IMPORT, True)
    ]
    assert any(v.rule == rules.THREADS and v.line == _line_of(bad, "os.fork") for v in violations)


def test_try_except_is_flagged_but_try_finally_is_not() -> None:
    body = "try:\n            out = cuda_extension.op(x, y)\n        except RuntimeError:\n            out = x"
    violations = check_model_new(FORWARD_TEMPLATE.format(body=body))
    assert [(v.rule, v.line) for v in violations] == [(rules.TRY_EXCEPT, 15)]
    body = "try:\n            out = cuda_extension.op(x, y)\n        finally:\n            pass"
    assert check_model_new(FORWARD_TEMPLATE.format(body=body)) == []


def test_dunder_methods_that_override_machinery_are_flagged() -> None:
    source = FORWARD_TEMPLATE.format(body="pass") + _src(
        """

        def __getattr__(name):
            return None


        class Helper:
            def __call__(self, x):
                return x

            def __repr__(self):
                return "Helper()"
        """
    )
    violations = check_model_new(source)
    assert [(v.rule, v.line) for v in violations] == [
        (rules.INTROSPECTION, _line_of(source, "def __getattr__")),
        (rules.INTROSPECTION, _line_of(source, "def __call__")),
    ]


def test_inherited_torch_layer_forward_is_compute() -> None:
    source = _src(
        """
        import torch.nn as nn
        import cuda_extension


        class ModelNew(nn.Linear):
            def forward(self, x):
                cuda_extension.noop(x)
                return super().forward(x)
        """
    )
    violations = check_model_new(source)
    assert [(v.rule, v.line) for v in violations] == [(rules.TORCH_COMPUTE, 8)]


def test_main_guard_may_use_reference_helpers() -> None:
    source = FORWARD_TEMPLATE.format(body="pass") + _src(
        """

        if __name__ == "__main__":
            print(ModelNew()(*get_inputs()))
        """
    )
    assert check_model_new(source) == []


# ----------------------------------------------------------------------------------------
# Extension use, structure and syntax
# ----------------------------------------------------------------------------------------


def test_workspace_without_extension_import() -> None:
    source = FORWARD_TEMPLATE.replace("import cuda_extension\n", "").replace(
        "out = cuda_extension.op(x, y)", "out = x.view(-1)"
    )
    violations = check_model_new(source)
    assert [(v.rule, v.line) for v in violations] == [
        (rules.NO_EXTENSION, _line_of(source, "class ModelNew"))
    ]
    assert "never imports `cuda_extension`" in violations[0].message


def test_forward_that_never_reaches_the_extension() -> None:
    source = _src(
        """
        import torch.nn as nn
        import cuda_extension


        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.ext = cuda_extension

            def unused(self, x):
                return self.ext.op(x)

            def forward(self, x):
                return x.view(-1)
        """
    )
    violations = check_model_new(source)
    assert [(v.rule, v.line) for v in violations] == [(rules.NO_EXTENSION, 13)]


def test_model_new_without_forward() -> None:
    source = (
        "import torch.nn as nn\nimport cuda_extension\n\nclass ModelNew(nn.Module):\n    pass\n"
    )
    violations = check_model_new(source)
    assert [(v.rule, v.line) for v in violations] == [(rules.NO_EXTENSION, 4)]


def test_single_file_without_load_inline() -> None:
    source = "import torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"
    violations = check_model_new(source, single_file=True)
    assert [v.rule for v in violations] == [rules.NO_EXTENSION]
    assert "load_inline" in violations[0].message


def test_missing_model_new_and_syntax_error() -> None:
    violations = check_model_new("import torch\n\nclass Model:\n    pass\n")
    assert [(v.rule, v.line) for v in violations] == [(rules.MISSING_MODELNEW, 0)]
    violations = check_model_new("import torch\n\ndef forward(self:\n    pass\n")
    assert len(violations) == 1
    assert violations[0].rule == rules.SYNTAX
    assert violations[0].line == 3


def test_violation_str_and_rule_list() -> None:
    v = Violation(rules.TORCH_COMPUTE, "model_new.py", 12, "`x.sum()` computes in PyTorch.")
    assert str(v) == "model_new.py:12: [torch-compute-op] `x.sum()` computes in PyTorch."
    assert str(Violation(rules.MISSING_MODELNEW, "model_new.py", 0, "m")).startswith(
        "model_new.py: ["
    )
    assert len(set(rules.STATIC)) == 11


def test_every_message_is_one_actionable_sentence() -> None:
    source = FORWARD_TEMPLATE.format(
        body="out = torch.relu(out) + x.sum()\n        import os\n        eval('1')"
    )
    for v in check_model_new(source):
        assert v.message.endswith("."), v
        assert v.message.count(". ") == 0, v


# ----------------------------------------------------------------------------------------
# C++ rules
# ----------------------------------------------------------------------------------------

BINDING_TEMPLATE = """\
#include <torch/extension.h>
#include "../binding_registry.h"

torch::Tensor op(torch::Tensor a, torch::Tensor b) {{
    auto out = torch::empty_like(a);
    {body}
    return out;
}}

REGISTER_BINDING(op, op);
"""


@pytest.mark.parametrize(
    ("body", "rule", "fragment"),
    [
        ("out = torch::matmul(a, b);", rules.TORCH_COMPUTE, "torch::matmul"),
        ("out = at::mm(a, b);", rules.TORCH_COMPUTE, "at::mm"),
        ("out = ::at::relu(a);", rules.TORCH_COMPUTE, "at::relu"),
        ("at::native::add_out(out, a, b);", rules.TORCH_COMPUTE, "at::native::add_out"),
        ("at::cuda::blas::gemm<float>();", rules.TORCH_COMPUTE, "at::cuda::blas::gemm"),
        (
            "out = torch::nn::functional::relu(a);",
            rules.TORCH_COMPUTE,
            "torch::nn::functional::relu",
        ),
        ("out = a.matmul(b);", rules.TORCH_COMPUTE, ".matmul("),
        ("out = a.contiguous().sum(1);", rules.TORCH_COMPUTE, ".sum("),
        ("out.add_(b);", rules.TORCH_COMPUTE, ".add_("),
        ("std::thread t([] {});", rules.THREADS, "std::thread"),
        ("auto f = std::async([] { return 1; });", rules.THREADS, "std::async"),
        ("pthread_create(nullptr, nullptr, nullptr, nullptr);", rules.THREADS, "pthread_create"),
        ("if (fork() == 0) return out;", rules.THREADS, "fork"),
        ("at::launch([] {});", rules.THREADS, "at::launch"),
        ("out = mm(a, b);", rules.TORCH_COMPUTE, "`mm(...)` unqualified"),  # argument-dependent lookup
        ("out = softmax(a, 1);", rules.TORCH_COMPUTE, "at::softmax"),
        ('system("ls");', rules.INTROSPECTION, "system"),
        ('FILE* f = fopen("x", "r");', rules.INTROSPECTION, "fopen"),
        ('std::ifstream in("ref.bin");', rules.INTROSPECTION, "std::ifstream"),
        ('auto F = py::module_::import("torch");', rules.INTROSPECTION, "py::module_::import"),
        ('void* h = dlopen("libx.so", 0);', rules.INTROSPECTION, "dlopen"),
        ("cblas_sgemm(0, 0, 0, 1, 1, 1, 1.f, 0, 1, 0, 1, 0.f, 0, 1);", rules.LIBRARY, "cblas_sgemm"),
        ("cutlass::gemm::GemmCoord c;", rules.LIBRARY, "cutlass::"),
        ('const char* p = "model.py";', rules.REFERENCE_FALLBACK, "model.py"),
    ],
)
def test_cpp_rule_breaks_are_named_with_their_line(body: str, rule: str, fragment: str) -> None:
    source = BINDING_TEMPLATE.format(body=body)
    violations = check_cpp_source(source, filename="kernels/op_binding.cpp", device="cuda")
    hits = [v for v in violations if v.rule == rule]
    assert hits, violations
    assert all(v.line == 6 for v in hits), hits
    assert any(fragment in v.message for v in hits), hits
    assert all(v.file == "kernels/op_binding.cpp" for v in violations)


def test_bare_threads_after_using_namespace_std_and_own_functions_of_aten_names() -> None:
    src = ("#include <thread>\n#include <torch/types.h>\nusing namespace std;\n"
           "void go() {\n  thread t([] {});\n  t.detach();\n  int threads = 4; (void)threads;\n}\n")
    hits = [v for v in check_cpp_source(src, filename="kernels/k.cpp", device="cpu") if v.rule == rules.THREADS]
    assert [v.line for v in hits] == [5] and "std::thread" in hits[0].message
    # a solution's own `relu`, declared in a header of a subfolder, is not ATen's
    files = {"model_new.py": "import cuda_extension\n", "kernels/util/act.h": "__device__ float relu(float x);\n",
             "kernels/k.cu": ('#include <torch/types.h>\n#include "util/act.h"\n'
                              "__global__ void k(float* p) { p[0] = relu(p[0]); }\n")}
    assert not [v for v in check_solution(files, device="cuda", single_file=False) if v.rule == rules.TORCH_COMPUTE]


@pytest.mark.parametrize(
    ("include", "device", "allowed"),
    [
        ("<cutlass/gemm/device/gemm.h>", "cuda", False),
        ("<cute/tensor.hpp>", "cuda", False),
        ("<Eigen/Dense>", "cpu", False),
        ("<mkl.h>", "cpu", False),
        ("<cblas.h>", "cpu", False),
        ("<dnnl.hpp>", "cpu", False),
        ("<cufft.h>", "cuda", False),
        ("<cusparse.h>", "cuda", False),
        ("<curand.h>", "cuda", False),
        ('"/usr/include/cutlass/cutlass.h"', "cuda", False),
        ('"missing.h"', "cuda", False),
        ('"../model.h"', "cuda", False),
        ("<cublas_v2.h>", "cuda", True),
        ("<cublasLt.h>", "cuda", True),
        ("<cudnn.h>", "cuda", True),
        ("<cub/cub.cuh>", "cuda", True),
        ("<thrust/sort.h>", "cuda", True),
        ("<cuda/pipeline>", "cuda", True),
        ("<cuda_pipeline.h>", "cuda", True),
        ("<curand_kernel.h>", "cuda", True),
        ("<cooperative_groups/reduce.h>", "cuda", True),
        ("<ATen/cuda/CUDAContext.h>", "cuda", True),
        ("<pybind11/pybind11.h>", "cpu", True),
        ("<omp.h>", "cpu", True),
        ("<immintrin.h>", "cpu", True),
        ("<arm_neon.h>", "cpu", True),
        ("<unordered_map>", "cpu", True),
        ("<math.h>", "cpu", True),
        ('"common.h"', "cpu", True),
        ('"../binding_registry.h"', "cpu", True),
    ],
)
def test_includes(include: str, device: str, allowed: bool) -> None:
    source = f"// header check\n#include {include}\nint x;\n"
    known = {"kernels/op.cpp", "kernels/common.h"}
    violations = check_cpp_source(
        source, filename="kernels/op.cpp", device=device, known_files=known
    )
    if allowed:
        assert violations == []
    else:
        assert [(v.rule, v.line) for v in violations] == [(rules.LIBRARY, 2)]


def test_pybind_module_only_in_locked_binding_or_single_file() -> None:
    source = '#include <torch/extension.h>\n\nPYBIND11_MODULE(cuda_extension, m) {\n  m.def("f", &f);\n}\n'
    violations = check_cpp_source(source, filename="kernels/f_binding.cpp", device="cuda")
    assert [(v.rule, v.line) for v in violations] == [(rules.INTROSPECTION, 3)]
    assert "REGISTER_BINDING" in violations[0].message
    assert check_cpp_source(source, filename="binding.cpp", device="cuda") == []
    assert check_cpp_source(source, filename="x", device="cuda", single_file=True) == []


def test_torch_library_registration_is_flagged() -> None:
    source = (
        '#include <torch/library.h>\nTORCH_LIBRARY_IMPL(aten, CUDA, m) {\n  m.impl("mm", &f);\n}\n'
    )
    violations = check_cpp_source(source, filename="kernels/x.cu", device="cuda")
    assert [(v.rule, v.line) for v in violations] == [(rules.INTROSPECTION, 2)]


def test_comments_and_strings_are_ignored_and_lines_stay_right() -> None:
    source = _src(
        """
        #include <torch/extension.h>
        /* torch::matmul(a, b);
           std::thread t; */
        // at::mm(a, b); x.sum();
        const char* s = "torch::relu(x) std::async \\" at::add(";
        const char* r = R"delim(
        torch::softmax(x); )" still raw
        )delim";
        char c = '"'; int n = 1'000;
        torch::Tensor f(torch::Tensor x) { return torch::tanh(x); }
        """
    )
    violations = check_cpp_source(source, filename="kernels/f.cu", device="cuda")
    assert [(v.rule, v.line, "torch::tanh" in v.message) for v in violations] == [
        (rules.TORCH_COMPUTE, 10, True)
    ]


def test_device_device_checked() -> None:
    with pytest.raises(ValueError):
        check_cpp_source("int x;", filename="k.cpp", device="rocm")
    with pytest.raises(ValueError):
        check_solution({}, device="gpu", single_file=False)


# ----------------------------------------------------------------------------------------
# Whole solutions, load_inline sources
# ----------------------------------------------------------------------------------------


def test_solution_file_dispatch() -> None:
    files = {
        "kernels/helper.py": "import torch\n",
        "kernels/op.cu": "#include <cutlass/cutlass.h>\n",
        "README.md": "#include <cutlass/cutlass.h>",
    }
    violations = check_solution(files, device="cuda", single_file=False)
    assert [(v.rule, v.file) for v in violations] == [
        (rules.MISSING_MODELNEW, "model_new.py"),
        (rules.FORBIDDEN_IMPORT, "kernels/helper.py"),
        (rules.LIBRARY, "kernels/op.cu"),
    ]


def test_inline_sources_are_checked_and_located_in_model_new() -> None:
    source = _src(
        '''
        import torch
        import torch.nn as nn
        from torch.utils.cpp_extension import load_inline

        HEADER = "#include <torch/extension.h>\\n"
        src = HEADER + r"""
        #include <cutlass/gemm.h>
        torch::Tensor f(torch::Tensor a, torch::Tensor b) {
            // torch::matmul in a comment is fine
            return torch::matmul(a, b).relu();
        }
        """
        ext = load_inline(
            name="x",
            cpp_sources="torch::Tensor f(torch::Tensor a, torch::Tensor b);",
            cuda_sources=src,
            functions=["f"],
            extra_ldflags=["-lcublas", "-lmkl_rt"],
        )


        class ModelNew(nn.Module):
            def forward(self, a, b):
                return ext.f(a, b)
        '''
    )
    violations = check_solution({"model_new.py": source}, device="cuda", single_file=True)
    got = sorted((v.rule, v.file, v.line) for v in violations)
    assert got == [
        (rules.LIBRARY, "model_new.py", 18),
        (rules.LIBRARY, "model_new.py:cuda_sources", 7),
        (rules.TORCH_COMPUTE, "model_new.py:cuda_sources", 10),
        (rules.TORCH_COMPUTE, "model_new.py:cuda_sources", 10),
    ]


def test_extract_inline_sources_follows_constants() -> None:
    sources = extract_inline_sources(LAZY_SINGLE_FILE)
    assert [s.kind for s in sources] == ["cpp_sources", "cuda_sources"]
    assert sources[0].text == "torch::Tensor f(torch::Tensor x);"
    cuda = sources[1]
    assert "torch::empty_like" in cuda.text
    line = next(i for i, t in enumerate(cuda.text.splitlines(), 1) if "empty_like" in t)
    assert cuda.python_line(line) == _line_of(LAZY_SINGLE_FILE, "empty_like")
    assert extract_inline_sources("def broken(:\n") == []


def test_load_inline_build_flags() -> None:
    ok = SINGLE_FILE_MODEL_NEW.replace(
        'extra_cflags=["-O3"],',
        'extra_cflags=["-O3"],\n    extra_cuda_cflags=["-O3", "-lineinfo", "--use_fast_math"],',
    )
    assert check_model_new(ok, single_file=True) == []
    bad = SINGLE_FILE_MODEL_NEW.replace(
        'extra_cflags=["-O3"],',
        'extra_cflags=["-O3", "-I/opt/cutlass/include"],\n    extra_include_paths=["/opt/eigen"],',
    )
    violations = check_model_new(bad, single_file=True)
    assert [(v.rule, v.line) for v in violations] == [
        (rules.LIBRARY, _line_of(bad, "-I/opt/cutlass")),
        (rules.LIBRARY, _line_of(bad, "/opt/eigen")),
    ]


def test_cpp_members_shared_with_cuda_libraries_are_not_torch_ops() -> None:
    source = _src(
        """
        #include <torch/extension.h>
        #include <cooperative_groups.h>
        namespace cg = cooperative_groups;
        __global__ void k(const float* x, int* flag) {
            auto tile = cg::tiled_partition<32>(cg::this_thread_block());
            if (tile.any(x[threadIdx.x] > 0.f) && tile.all(true)) *flag = 1;
        }
        torch::Tensor f(torch::Tensor x) {
            std::vector<torch::Tensor> outs = {x};
            return torch::cat(outs, 0).reshape({-1});
        }
        """
    )
    assert check_cpp_source(source, filename="kernels/k.cu", device="cuda") == []


def test_aten_cpu_vector_kernels_are_torch_ops() -> None:
    source = "#include <ATen/cpu/vec/vec.h>\nusing V = at::vec::Vectorized<float>;\n"
    violations = check_cpp_source(source, filename="kernels/k.cpp", device="cpu")
    assert [(v.rule, v.line) for v in violations] == [(rules.TORCH_COMPUTE, 2)]


def test_hostile_python_does_not_crash_the_checker() -> None:
    deep = "import cuda_extension\n\n\nclass ModelNew:\n    def forward(self, x):\n"
    deep += "        return " + "+".join(["x"] * 50000) + "\n"
    assert [v.rule for v in check_model_new(deep)] == [rules.SYNTAX]
    assert [v.rule for v in check_model_new("x = 1\0\n")] == [rules.SYNTAX]
    assert extract_inline_sources(deep) == []
