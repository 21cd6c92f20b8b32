"""Legitimate but unusual solutions pass the whole pipeline, profiled: the trust boundary's
checks (the parent's batches, committed outputs, the op watch, the relative tolerance)
must not reject honest work. One kernel set serves both tasks (one build): OpenMP and
at::parallel_for loops, a templated kernel, a header in a subfolder, a tuple of outputs,
integer and boolean inputs, fp16 arithmetic within tolerance, and a linear layer whose
weight is kept pre-transposed in a non-persistent buffer."""

from __future__ import annotations

from pathlib import Path

from . import cases as C
from .test_profile_cpu import prof

MIXED_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """A signed pick by a mask plus integer offsets, and a scaled copy: two outputs."""

    def __init__(self):
        super().__init__()

    def forward(self, x, idx, mask):
        return torch.where(mask, x, -x) + idx.to(x.dtype), x * 0.5


n = 1 << 16


def get_inputs():
    return [torch.randn(n), torch.randint(0, 10, (n,)), torch.rand(n) > 0.5]


def get_init_inputs():
    return []
'''

FRIENDLY = {
    "kernels/util/pick.h": '''#pragma once
// sign of v picked by a mask: a template, in a header of a subfolder
template <typename T>
inline T signed_pick(bool keep, T v) { return keep ? v : -v; }
''',
    "kernels/mixed.cpp": '''#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cstdint>
#include "util/pick.h"

template <typename T>
static void pick_add(T* y, const T* x, const int64_t* idx, const bool* mask, int64_t n) {
  at::parallel_for(0, n, 2048, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) y[i] = signed_pick(mask[i], x[i]) + static_cast<T>(idx[i]);
  });
}

extern "C" void mixed_launcher(float* y, float* half_out, const float* x, const int64_t* idx, const bool* mask,
                               int64_t n) {
  pick_add<float>(y, x, idx, mask, n);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) half_out[i] = static_cast<float>(c10::Half(x[i]) * c10::Half(0.5f));
}

// y[i, o] = max(0, b[o] + sum_k x[i, k] * wt[k, o]); the weight pre-transposed
extern "C" void linear_relu_t_launcher(float* y, const float* x, const float* wt, const float* b, int64_t n,
                                       int64_t in, int64_t out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    float* yr = y + i * out;
    for (int64_t o = 0; o < out; ++o) yr[o] = b[o];
    for (int64_t k = 0; k < in; ++k) {
      const float xv = x[i * in + k];
      const float* wr = wt + k * out;
      for (int64_t o = 0; o < out; ++o) yr[o] += xv * wr[o];
    }
    for (int64_t o = 0; o < out; ++o) yr[o] = yr[o] > 0.f ? yr[o] : 0.f;
  }
}
''',
    "kernels/friendly_binding.cpp": C.BINDING_HEAD + '''#include <tuple>

extern "C" void mixed_launcher(float*, float*, const float*, const int64_t*, const bool*, int64_t);
extern "C" void linear_relu_t_launcher(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);

static std::tuple<torch::Tensor, torch::Tensor> mixed(torch::Tensor x, torch::Tensor idx, torch::Tensor mask) {
  TORCH_CHECK(x.is_contiguous() && idx.is_contiguous() && mask.is_contiguous(), "mixed: contiguous inputs");
  auto y = torch::empty_like(x);
  auto h = torch::empty_like(x);
  mixed_launcher(y.data_ptr<float>(), h.data_ptr<float>(), x.data_ptr<float>(), idx.data_ptr<int64_t>(),
                 mask.data_ptr<bool>(), x.numel());
  return {y, h};
}

static torch::Tensor linear_relu_t(torch::Tensor x, torch::Tensor wt, torch::Tensor b) {
  TORCH_CHECK(x.is_contiguous() && wt.is_contiguous() && x.size(1) == wt.size(0), "linear_relu_t: shapes");
  auto y = torch::empty({x.size(0), wt.size(1)}, x.options());
  linear_relu_t_launcher(y.data_ptr<float>(), x.data_ptr<float>(), wt.data_ptr<float>(), b.data_ptr<float>(),
                         x.size(0), x.size(1), wt.size(1));
  return y;
}

static void register_friendly(pybind11::module& m) {
  m.def("mixed", &mixed);
  m.def("linear_relu_t", &linear_relu_t);
}
REGISTER_BINDING(friendly, register_friendly);
''',
}

MIXED_MODEL_NEW = '''import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, idx, mask):
        return cuda_extension.mixed(x, idx, mask)
'''

# The weight, transposed once into a buffer that is not part of the state_dict.
PRETRANSPOSED_MODEL_NEW = '''import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.register_buffer("weight_t", torch.empty(0), persistent=False)

    def forward(self, x):
        if self.weight_t.numel() == 0:
            self.weight_t = self.linear.weight.detach().t().contiguous()
        return cuda_extension.linear_relu_t(x, self.weight_t, self.linear.bias)
'''


def test_a_tuple_of_outputs_from_integer_and_boolean_inputs_through_templates_headers_and_fp16(
        tmp_path: Path) -> None:
    task = tmp_path / "mixed_task.py"
    task.write_text(MIXED_TASK)
    res = prof(tmp_path / "mixed", {"model_new.py": MIXED_MODEL_NEW, **FRIENDLY}, task)
    assert res.status == "ok", res.message
    assert res.speedup_vs_eager and res.details.get("vouched"), res.details


def test_a_pre_transposed_weight_in_a_non_persistent_buffer(tmp_path: Path) -> None:
    res = prof(tmp_path, {"model_new.py": PRETRANSPOSED_MODEL_NEW, **FRIENDLY}, C.LINEAR_RELU_TASK)
    assert res.status == "ok", res.message
