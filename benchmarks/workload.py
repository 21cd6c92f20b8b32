"""A rollout-like evaluation workload: solutions of synthesized tasks, written the way a
policy's attempts come in during RL.

From a datagen dataset (`examples/datagen/*.jsonl`) it takes the tasks whose operators are
all elementwise (activations, clamp, abs, scaling: their kernels can be written here from
the operator list), and writes for each task `per_task` solutions, each with new content:

    fused    one kernel, float4 loads (CUDA) / one parallel loop (CPU): correct, fast
    plain    one kernel, one element per thread: correct
    passes   one kernel per operator, each a pass over memory: correct, slower
    wrong    the fused kernel with its result off by 5% (+0.02): incorrect
    typo     an undeclared name in the kernel: a compile error

in the mix MIX, block sizes and comments varying between variants (so every variant is a
new build, as in RL). Each `Variant` carries the verdict it must get.

    python benchmarks/workload.py examples/datagen/h200_205.jsonl --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (kind, expected status): six correct of three speeds, two incorrect, two compile errors
MIX = [("fused", "ok"), ("fused", "ok"), ("plain", "ok"), ("plain", "ok"), ("passes", "ok"), ("passes", "ok"),
       ("wrong", "incorrect"), ("wrong", "incorrect"), ("typo", "compile_error"), ("typo", "compile_error")]

SELU_SCALE, SELU_ALPHA = 1.0507009873554805, 1.6732632423543772


def _f(v: float) -> str:
    return f"{float(v)!r}f".replace("inff", "INFINITY")


def op_expr(op: str, p: dict[str, Any]) -> str:
    """C++ statements on `x` (float) for one operator, as torch defines it."""
    if op == "ReLU":
        return "x = fmaxf(x, 0.f);"
    if op == "ReLU6":
        return "x = fminf(fmaxf(x, 0.f), 6.f);"
    if op == "Sigmoid":
        return "x = 1.f / (1.f + expf(-x));"
    if op == "Tanh":
        return "x = tanhf(x);"
    if op == "Tanhshrink":
        return "x = x - tanhf(x);"
    if op == "SiLU":
        return "x = x / (1.f + expf(-x));"
    if op == "GELU":
        if p.get("approximate") == "tanh":
            return "x = 0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));"
        return "x = 0.5f * x * (1.f + erff(x * 0.70710678118f));"
    if op == "Hardswish":
        return "x = x * fminf(fmaxf(x + 3.f, 0.f), 6.f) / 6.f;"
    if op == "Hardsigmoid":
        return "x = fminf(fmaxf(x + 3.f, 0.f), 6.f) / 6.f;"
    if op == "Softplus":
        b, t = _f(p.get("beta", 1.0)), _f(p.get("threshold", 20.0))
        return f"x = (x * {b} > {t}) ? x : log1pf(expf({b} * x)) / {b};"
    if op == "Mish":
        return "x = x * tanhf(x > 20.f ? x : log1pf(expf(x)));"
    if op == "Softsign":
        return "x = x / (1.f + fabsf(x));"
    if op == "Hardtanh":
        return f"x = fminf(fmaxf(x, {_f(p.get('min_val', -1.0))}), {_f(p.get('max_val', 1.0))});"
    if op == "LeakyReLU":
        return f"x = x > 0.f ? x : x * {_f(p.get('negative_slope', 0.01))};"
    if op == "ELU":
        return f"x = x > 0.f ? x : {_f(p.get('alpha', 1.0))} * (expf(x) - 1.f);"
    if op == "CELU":
        a = _f(p.get("alpha", 1.0))
        return f"x = fmaxf(0.f, x) + fminf(0.f, {a} * (expf(x / {a}) - 1.f));"
    if op == "SELU":
        return f"x = {_f(SELU_SCALE)} * (x > 0.f ? x : {_f(SELU_ALPHA)} * (expf(x) - 1.f));"
    if op == "Hardshrink":
        lam = _f(p.get("lambd", 0.5))
        return f"x = (x > {lam} || x < -{lam}) ? x : 0.f;"
    if op == "Softshrink":
        lam = _f(p.get("lambd", 0.5))
        return f"x = x > {lam} ? x - {lam} : (x < -{lam} ? x + {lam} : 0.f);"
    if op == "LogSigmoid":
        return "x = x < 0.f ? x - log1pf(expf(x)) : -log1pf(expf(-x));"
    if op == "abs":
        return "x = fabsf(x);"
    if op == "clamp":
        return f"x = fminf(fmaxf(x, {_f(p['min'])}), {_f(p['max'])});"
    if op == "scale":
        return f"x = x * {_f(p['factor'])};"
    raise KeyError(op)


ELEMENTWISE = {"ReLU", "ReLU6", "Sigmoid", "Tanh", "Tanhshrink", "SiLU", "GELU", "Hardswish", "Hardsigmoid",
               "Softplus", "Mish", "Softsign", "Hardtanh", "LeakyReLU", "ELU", "CELU", "SELU", "Hardshrink",
               "Softshrink", "LogSigmoid", "abs", "clamp", "scale"}
DISCONTINUOUS = {"Hardshrink"}
_PARAMS = ("beta", "threshold", "min_val", "max_val", "negative_slope", "alpha", "lambd", "approximate")


def chain_of(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
    """The task's operators in order with their parameters, or None where one is not
    elementwise. Module parameters are read from the task's own modules (the task's code
    is run here: datasets are trusted input)."""
    ops = list(row.get("ops") or [])
    if not ops or not all(o in ELEMENTWISE for o in ops):
        return None
    if any(o in DISCONTINUOUS for o in ops[1:]):
        # after another operator, last-bit differences from torch's arithmetic move a value
        # across the jump (CELU's -0.5000001 vs -0.5 at Hardshrink's 0.5): a correct kernel
        # can then differ by the jump's height on an element, and is judged incorrect
        return None
    import torch.nn as nn

    scope: dict[str, Any] = {}
    exec(compile(row["code"], "<task>", "exec"), scope)  # noqa: S102 (a dataset's task, trusted)
    model = scope["Model"](*scope["get_init_inputs"]())
    modules = [m for m in model.modules() if m is not model and not isinstance(m, nn.Sequential)]
    forward = row["code"][row["code"].index("def forward"):]
    clamps = [(float(a), float(b)) for a, b in re.findall(r"torch\.clamp\(x, min=([-\d.e]+), max=([-\d.e]+)\)", forward)]
    scales = [float(a) for a in re.findall(r"x = x \* ([-\d.e]+)", forward)]
    chain = []
    for op in ops:
        if op == "clamp":
            lo, hi = clamps.pop(0)
            chain.append((op, {"min": lo, "max": hi}))
        elif op == "scale":
            chain.append((op, {"factor": scales.pop(0)}))
        elif op == "abs":
            chain.append((op, {}))
        else:
            m = modules.pop(0)
            if type(m).__name__ != op:
                return None
            chain.append((op, {k: getattr(m, k) for k in _PARAMS if hasattr(m, k)}))
    return chain


def _body(chain: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"  {op_expr(op, p)}" for op, p in chain)


def kernels(chain: list[tuple[str, dict[str, Any]]], kind: str, device: str, tag: str, rng: random.Random) -> dict[str, str]:
    """The kernel and binding files of one variant."""
    head = f"// {kind} variant {tag}\n"
    wrong = "  x = x * 1.05f + 0.02f;\n" if kind == "wrong" else ""
    typo = " + bias_undeclared" if kind == "typo" else ""
    if device == "cuda":
        threads = rng.choice([128, 256, 512])
        fn = f"__device__ __forceinline__ float chain_op(float x) {{\n{_body(chain)}\n{wrong}  return x;\n}}\n"
        if kind == "passes":
            parts = [f"__device__ __forceinline__ float op{k}(float x) {{\n  {op_expr(op, p)}\n  return x;\n}}\n"
                     f"__global__ void pass{k}(float* out, const float* in, int64_t n) {{\n"
                     f"  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
                     f"  if (i < n) out[i] = op{k}(in[i]);\n}}\n" for k, (op, p) in enumerate(chain)]
            calls = "\n".join(f"  pass{k}<<<blocks, {threads}, 0, stream>>>(out, {'in' if k == 0 else 'out'}, n);"
                              for k in range(len(chain)))
            src = "".join(parts) + (
                "extern \"C\" void chain_launcher(float* out, const float* in, int64_t n, cudaStream_t stream) {\n"
                f"  if (n <= 0) return;\n  int64_t blocks = (n + {threads} - 1) / {threads};\n{calls}\n}}\n")
        elif kind == "plain":
            src = fn + (
                "__global__ void chain_kernel(float* out, const float* in, int64_t n) {\n"
                "  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
                f"  if (i < n) out[i] = chain_op(in[i]){typo};\n}}\n"
                "extern \"C\" void chain_launcher(float* out, const float* in, int64_t n, cudaStream_t stream) {\n"
                f"  if (n <= 0) return;\n  chain_kernel<<<(n + {threads} - 1) / {threads}, {threads}, 0, stream>>>(out, in, n);\n}}\n")
        else:  # fused, wrong, typo: float4 loads, grid-stride
            src = fn + (
                "__global__ void chain_vec4(float4* out, const float4* in, int64_t n4) {\n"
                "  int64_t stride = (int64_t)gridDim.x * blockDim.x;\n"
                "  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += stride) {\n"
                "    float4 v = in[i];\n"
                f"    out[i] = make_float4(chain_op(v.x), chain_op(v.y), chain_op(v.z), chain_op(v.w)){typo};\n"
                "  }\n}\n"
                "__global__ void chain_tail(float* out, const float* in, int64_t start, int64_t n) {\n"
                "  int64_t i = start + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
                "  if (i < n) out[i] = chain_op(in[i]);\n}\n"
                "extern \"C\" void chain_launcher(float* out, const float* in, int64_t n, cudaStream_t stream) {\n"
                "  if (n <= 0) return;\n  int64_t n4 = n / 4;\n"
                f"  if (n4 > 0) {{\n    int64_t blocks = (n4 + {threads} - 1) / {threads};\n"
                "    if (blocks > 65535 * 8) blocks = 65535 * 8;\n"
                f"    chain_vec4<<<blocks, {threads}, 0, stream>>>(reinterpret_cast<float4*>(out), "
                "reinterpret_cast<const float4*>(in), n4);\n  }\n"
                f"  if (n - n4 * 4 > 0) chain_tail<<<1, {threads}, 0, stream>>>(out, in, n4 * 4, n);\n}}\n")
        kernel = "#include <cuda_runtime.h>\n#include <cstdint>\n#include <math.h>\n\n" + head + src
        binding = (
            "#include <torch/types.h>\n#include <torch/csrc/utils/pybind.h>\n#include <c10/cuda/CUDAStream.h>\n\n"
            "#include \"../binding_registry.h\"\n\n"
            "extern \"C\" void chain_launcher(float* out, const float* in, int64_t n, cudaStream_t stream);\n\n"
            "static torch::Tensor chain(torch::Tensor x) {\n"
            "  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "
            "\"chain: a contiguous float32 CUDA tensor expected\");\n"
            "  auto out = torch::empty_like(x);\n"
            "  chain_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel(), "
            "c10::cuda::getCurrentCUDAStream().stream());\n  return out;\n}\n\n"
            "static void register_chain(pybind11::module& m) { m.def(\"chain\", &chain, py::arg(\"x\")); }\n\n"
            "REGISTER_BINDING(chain, register_chain);\n")
        return {"kernels/chain.cu": kernel, "kernels/chain_binding.cpp": binding}
    # the CPU backend: OpenMP loops
    fn = f"static inline float chain_op(float x) {{\n{_body(chain)}\n{wrong}  return x;\n}}\n"
    if kind == "passes":
        parts = [f"static inline float op{k}(float x) {{\n  {op_expr(op, p)}\n  return x;\n}}\n"
                 for k, (op, p) in enumerate(chain)]
        loops = "\n".join(f"  #pragma omp parallel for schedule(static)\n  for (int64_t i = 0; i < n; ++i) "
                          f"out[i] = op{k}({'in' if k == 0 else 'out'}[i]);" for k in range(len(chain)))
        src = "".join(parts) + f"extern \"C\" void chain_launcher(float* out, const float* in, int64_t n) {{\n{loops}\n}}\n"
    else:
        sched = "static" if kind != "plain" else f"dynamic, {rng.choice([1024, 4096, 16384])}"
        src = fn + ("extern \"C\" void chain_launcher(float* out, const float* in, int64_t n) {\n"
                    f"  #pragma omp parallel for schedule({sched})\n"
                    f"  for (int64_t i = 0; i < n; ++i) out[i] = chain_op(in[i]){typo};\n}}\n")
    kernel = "#include <cmath>\n#include <cstdint>\n\n" + head + src.replace("expf(", "std::exp(").replace(
        "tanhf(", "std::tanh(").replace("log1pf(", "std::log1p(").replace("erff(", "std::erf(")
    binding = (
        "#include <torch/types.h>\n#include <torch/csrc/utils/pybind.h>\n\n#include \"../binding_registry.h\"\n\n"
        "extern \"C\" void chain_launcher(float* out, const float* in, int64_t n);\n\n"
        "static torch::Tensor chain(torch::Tensor x) {\n"
        "  TORCH_CHECK(x.is_cpu() && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "
        "\"chain: a contiguous float32 CPU tensor expected\");\n"
        "  auto out = torch::empty_like(x);\n"
        "  chain_launcher(out.data_ptr<float>(), x.data_ptr<float>(), x.numel());\n  return out;\n}\n\n"
        "static void register_chain(pybind11::module& m) { m.def(\"chain\", &chain, py::arg(\"x\")); }\n\n"
        "REGISTER_BINDING(chain, register_chain);\n")
    return {"kernels/chain.cpp": kernel, "kernels/chain_binding.cpp": binding}


MODEL_NEW = '''import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    """{doc}"""

    def __init__(self, *args):
        super().__init__()

    def forward(self, x):
        return cuda_extension.chain(x)
'''


@dataclass
class Variant:
    task_name: str
    task_code: str
    files: dict[str, str]
    kind: str
    expect: str  # the status it must get: ok, incorrect, compile_error

    def to_json(self) -> dict[str, Any]:
        return {"task_name": self.task_name, "task_code": self.task_code, "files": self.files, "kind": self.kind,
                "expect": self.expect}


def workload(dataset: Path, device: str, *, tasks: int = 20, per_task: int = 10, seed: int = 0) -> list[Variant]:
    """`per_task` variants of each of the first `tasks` elementwise tasks of `dataset`,
    shuffled as rollouts would interleave them."""
    rng = random.Random(seed)
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    out: list[Variant] = []
    picked = 0
    for row in rows:
        chain = chain_of(row)
        if chain is None:
            continue
        name = f"{row.get('task_id', picked)}_{'_'.join(o for o, _ in chain)}"
        for k in range(per_task):
            kind, expect = MIX[k % len(MIX)]
            tag = f"{name}/{k}/{rng.getrandbits(32):08x}"
            files = {"model_new.py": MODEL_NEW.format(doc=f"{' then '.join(o for o, _ in chain)} ({tag})"),
                     **kernels(chain, kind, device, tag, rng)}
            out.append(Variant(name, row["code"], files, kind, expect))
        picked += 1
        if picked >= tasks:
            break
    rng.shuffle(out)
    return out


def input_bytes(task_code: str) -> int:
    """The size of a task's inputs, from its get_inputs() on the meta device (nothing allocated)."""
    import torch

    ns: dict[str, Any] = {"__name__": "task"}
    exec(compile(task_code, "<task>", "exec"), ns)
    with torch.device("meta"):
        inputs = ns["get_inputs"]()
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--per-task", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True, help="writes workload.jsonl there")
    args = ap.parse_args()
    vs = workload(args.dataset, args.device, tasks=args.tasks, per_task=args.per_task)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "workload.jsonl", "w") as f:
        for v in vs:
            f.write(json.dumps(v.to_json()) + "\n")
    print(f"{len(vs)} variants of {len({v.task_name for v in vs})} tasks -> {args.out / 'workload.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
