"""CPU solutions used by the evaluator tests: correct ones, and one per broken rule or fault.

Solutions that differ only in model_new.py share their compiled extension through the
content-hash build cache, so most of these compile nothing new.
"""

from __future__ import annotations

from pathlib import Path

from cuda_agent.evaluator.options import EvalOptions

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TASKS = REPO / "tests" / "tasks" / "data"

AXPBY_TASK = EXAMPLES / "tasks" / "axpby.py"
AXPBY_KERNELS = {
    f"kernels/{p.name}": p.read_text() for p in sorted((EXAMPLES / "solutions" / "axpby_cpu" / "kernels").iterdir())
}
AXPBY_MODEL_NEW = (EXAMPLES / "solutions" / "axpby_cpu" / "model_new.py").read_text()

# trials of every evaluation: the task's own and those on other input distributions
TRIALS = EvalOptions().trials + EvalOptions().distribution_trials

BINDING_HEAD = """#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"
"""


def axpby(model_new: str | None = None, **kernels: str) -> dict[str, str]:
    """The example axpby solution, with model_new.py or kernel files replaced."""
    files = {"model_new.py": model_new or AXPBY_MODEL_NEW, **AXPBY_KERNELS}
    for name, text in kernels.items():
        files[f"kernels/{name.replace('__', '.')}"] = text
    return files


def forward(body: str, *, imports: str = "", init: str = "") -> str:
    """An axpby ModelNew with the given forward body (indented 8 spaces)."""
    return (
        f"import torch\nimport torch.nn as nn\n{imports}\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, alpha):\n"
        "        super().__init__()\n"
        f"        self.alpha = alpha\n{init}\n"
        "    def forward(self, a, b):\n"
        + "".join(f"        {line}\n" for line in body.strip().splitlines())
    )


def binding(body: str, *, extra: str = "", name: str = "axpby") -> str:
    """A CPU binding whose function `name(a, b, alpha)` has the given C++ body."""
    return (
        BINDING_HEAD + extra + "\nextern \"C\" void axpby_launcher(float*, const float*, const float*, float, int64_t);\n\n"
        f"static torch::Tensor {name}(torch::Tensor a, torch::Tensor b, double alpha) {{\n{body}\n}}\n\n"
        f"static void register_{name}(pybind11::module& m) {{ m.def(\"{name}\", &{name}); }}\n"
        f"REGISTER_BINDING({name}, register_{name});\n"
    )


CALL = "auto out = torch::empty_like(a);\n  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());\n"

# --- Correct solutions of other tasks ------------------------------------------------------

RELU_TASK = TASKS / "19_ReLU.py"
RELU = {
    "model_new.py": (
        "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n\n"
        "    def forward(self, x):\n        return cuda_extension.relu(x)\n"
    ),
    "kernels/relu.cpp": (
        "#include <cstdint>\n#include <algorithm>\n"
        "extern \"C\" void relu_launcher(float* out, const float* x, int64_t n) {\n"
        "#pragma omp parallel for if (n > 65536)\n"
        "  for (int64_t i = 0; i < n; ++i) out[i] = std::max(x[i], 0.0f);\n}\n"
    ),
    "kernels/relu_binding.cpp": (
        BINDING_HEAD
        + "extern \"C\" void relu_launcher(float*, const float*, int64_t);\n"
        "static torch::Tensor relu(torch::Tensor x) {\n"
        "  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, \"relu: contiguous float32\");\n"
        "  auto out = torch::empty_like(x);\n"
        "  relu_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel());\n  return out;\n}\n"
        "static void register_relu(pybind11::module& m) { m.def(\"relu\", &relu); }\n"
        "REGISTER_BINDING(relu, register_relu);\n"
    ),
}

CHAIN_TASK = TASKS / "Elementwise_Chain.py"


def chain(passes: int) -> dict[str, str]:
    """A solution of the elementwise-chain task whose speed is set by `passes`: the six
    steps are done in that many passes over memory (eager makes twelve, torch.compile one)."""
    assert 6 % passes == 0
    return {
        "model_new.py": (
            "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
            "class ModelNew(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n\n"
            "    def forward(self, x):\n"
            f"        for _ in range({passes}):\n"
            f"            x = cuda_extension.chain(x, {6 // passes})\n"
            "        return x\n"
        ),
        "kernels/chain.cpp": (
            "#include <cstdint>\n"
            "#include <algorithm>\n"
            "extern \"C\" void chain_launcher(float* out, const float* x, int64_t n, int64_t steps) {\n"
            "  // One pass over memory: each 16 KB block is copied, then stepped while it is in L1,\n"
            "  // with the steps as vectorisable inner loops (a loop over steps per element is not).\n"
            "#pragma omp parallel for if (n > 65536)\n"
            "  for (int64_t b = 0; b < n; b += 4096) {\n"
            "    const int64_t e = std::min(n, b + 4096);\n"
            "    for (int64_t i = b; i < e; ++i) out[i] = x[i];\n"
            "    for (int64_t s = 0; s < steps; ++s)\n"
            "      for (int64_t i = b; i < e; ++i) out[i] = out[i] * 0.9f + 0.1f;\n"
            "  }\n}\n"
        ),
        "kernels/chain_binding.cpp": (
            BINDING_HEAD
            + "extern \"C\" void chain_launcher(float*, const float*, int64_t, int64_t);\n"
            "static torch::Tensor chain(torch::Tensor x, int64_t steps) {\n"
            "  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, \"chain: contiguous float32\");\n"
            "  auto out = torch::empty_like(x);\n"
            "  chain_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel(), steps);\n  return out;\n}\n"
            "static void register_chain(pybind11::module& m) { m.def(\"chain\", &chain); }\n"
            "REGISTER_BINDING(chain, register_chain);\n"
        ),
    }


LINEAR_RELU_TASK = TASKS / "76_Linear_ReLU.py"
LINEAR_RELU = {
    "model_new.py": (
        "import torch\nimport torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, in_features, out_features):\n"
        "        super().__init__()\n"
        "        self.linear = nn.Linear(in_features, out_features)\n\n"
        "    def forward(self, x):\n"
        "        return cuda_extension.linear_relu(x, self.linear.weight, self.linear.bias)\n"
    ),
    "kernels/linear_relu.cpp": (
        "#include <cstdint>\n"
        "// y[i, o] = max(0, b[o] + sum_k x[i, k] * w[o, k]); w rows are contiguous in k.\n"
        "extern \"C\" void linear_relu_launcher(float* y, const float* x, const float* w, const float* b,\n"
        "                                     int64_t n, int64_t in, int64_t out) {\n"
        "#pragma omp parallel for collapse(2)\n"
        "  for (int64_t i = 0; i < n; ++i)\n"
        "    for (int64_t o = 0; o < out; ++o) {\n"
        "      const float* xr = x + i * in; const float* wr = w + o * in;\n"
        "      float acc = b[o];\n"
        "      for (int64_t k = 0; k < in; ++k) acc += xr[k] * wr[k];\n"
        "      y[i * out + o] = acc > 0.f ? acc : 0.f;\n"
        "    }\n}\n"
    ),
    "kernels/linear_relu_binding.cpp": (
        BINDING_HEAD
        + "extern \"C\" void linear_relu_launcher(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);\n"
        "static torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {\n"
        "  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), \"linear_relu: shapes\");\n"
        "  x = x.contiguous(); w = w.contiguous(); b = b.contiguous();\n"
        "  auto y = torch::empty({x.size(0), w.size(0)}, x.options());\n"
        "  linear_relu_launcher(y.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(),\n"
        "                       x.size(0), x.size(1), w.size(0));\n  return y;\n}\n"
        "static void register_linear_relu(pybind11::module& m) { m.def(\"linear_relu\", &linear_relu); }\n"
        "REGISTER_BINDING(linear_relu, register_linear_relu);\n"
    ),
}

SOFTMAX_TASK = TASKS / "23_Softmax.py"
# KernelBench's single-file format: the extension is built with load_inline.
SOFTMAX_SINGLE_FILE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

softmax_cpp = """
#include <cmath>
torch::Tensor row_softmax(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "2-D contiguous input expected");
    auto y = torch::empty_like(x);
    const int64_t rows = x.size(0), cols = x.size(1);
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    #pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = in + r * cols;
        float* yr = out + r * cols;
        float m = xr[0];
        for (int64_t c = 1; c < cols; ++c) m = xr[c] > m ? xr[c] : m;
        float s = 0.f;
        for (int64_t c = 0; c < cols; ++c) { yr[c] = std::exp(xr[c] - m); s += yr[c]; }
        const float inv = 1.f / s;
        for (int64_t c = 0; c < cols; ++c) yr[c] *= inv;
    }
    return y;
}
"""

softmax_ext = load_inline(
    name="row_softmax_ext",
    cpp_sources=softmax_cpp,
    functions=["row_softmax"],
    extra_cflags=["-O3"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return softmax_ext.row_softmax(x)
'''
