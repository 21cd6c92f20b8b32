#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/cuda/CUDAStream.h>

#include "../binding_registry.h"

extern "C" void axpby_launcher(float* out, const float* a, const float* b, float alpha, int64_t n,
                               cudaStream_t stream);

static torch::Tensor axpby(torch::Tensor a, torch::Tensor b, double alpha) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda(), "axpby: CUDA tensors expected");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "axpby: contiguous tensors expected");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32, "axpby: float32 only");
  TORCH_CHECK(a.sizes() == b.sizes(), "axpby: a and b must have the same shape");
  auto out = torch::empty_like(a);
  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                 static_cast<float>(alpha), a.numel(), c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

static void register_axpby(pybind11::module& m) {
  m.def("axpby", &axpby, py::arg("a"), py::arg("b"), py::arg("alpha"));
}

REGISTER_BINDING(axpby, register_axpby);
