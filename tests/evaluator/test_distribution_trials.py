"""Trials on other input distributions (`distributions`): a constant, a formula of a summary
and a kernel that reads a sample of its input pass the task's own trials of a loss on
`torch.rand` inputs, and fail those; a task undefined on some distributions skips them;
the timed calls' inputs include them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cuda_agent.evaluator import distributions as D
from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules

from . import cases as C
from .test_evaluate_cpu import run
from .test_profile_cpu import prof

MSE_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Mean squared error of predictions and targets."""

    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


batch_size = 128
input_shape = (4096,)


def get_inputs():
    return [torch.rand(batch_size, *input_shape), torch.rand(batch_size, *input_shape)]


def get_init_inputs():
    return []
'''

# log(1 - x) of x in [0, 1): not finite for x > 1, where the normal and heavy-tailed trials
# go (the scaled one keeps values of [0, 1] there); the raising variant refuses such inputs.
LOG_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):{check}
        return torch.log(1 - x)


def get_inputs():
    return [torch.rand(1 << 16)]


def get_init_inputs():
    return []
'''
RAISES = '''
        if bool((x > 1).any()):
            raise ValueError("x must be at most 1")'''

# One kernel file (one build): `mse(p, t, mode)` is exact (0), the constant 1/6 (1), the
# expected loss of uniform inputs from the mean of `p` (2), the loss over every 16th element
# (3), or exact for the first eight calls (the trials) and the constant after (4).
KERNELS = {"kernels/mse.cpp": C.BINDING_HEAD + r'''
#include <cmath>

static torch::Tensor scalar(const torch::Tensor& like, double v) {
  auto out = torch::empty({}, like.options());
  out.data_ptr<float>()[0] = static_cast<float>(v);
  return out;
}

static torch::Tensor mse(torch::Tensor p, torch::Tensor t, int64_t mode) {
  TORCH_CHECK(p.is_contiguous() && t.is_contiguous() && p.scalar_type() == torch::kFloat32, "mse: contiguous float32");
  static int64_t calls = 0;
  ++calls;
  const float* a = p.data_ptr<float>();
  const float* b = t.data_ptr<float>();
  const int64_t n = p.numel();
  if (mode == 1 || (mode == 4 && calls > 8)) return scalar(p, 1.0 / 6.0);
  if (mode == 2) {
    double m = 0;
    for (int64_t i = 0; i < n; ++i) m += a[i];
    m /= n;
    return scalar(p, 2.0 * m * m / 3.0);  // two uniforms on [0, 2m]: E (x - y)^2 = 2 (2m)^2 / 12
  }
  const int64_t step = mode == 3 ? 16 : 1;
  double s = 0;
  int64_t k = 0;
  for (int64_t i = 0; i < n; i += step, ++k) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return scalar(p, s / k);
}

static torch::Tensor log1m(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "log1m: contiguous float32");
  auto out = torch::empty_like(x);
  const float* v = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) y[i] = std::log(1.0f - v[i]);
  return out;
}

static void register_mse(pybind11::module& m) {
  m.def("mse", &mse);
  m.def("log1m", &log1m);
}
REGISTER_BINDING(mse, register_mse);
'''}


def mse_solution(mode: int) -> dict[str, str]:
    return {"model_new.py": (
        "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
        "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
        f"    def forward(self, predictions, targets):\n        return cuda_extension.mse(predictions, targets, {mode})\n"),
        **KERNELS}


LOG = {"model_new.py": (
    "import torch.nn as nn\n\nimport cuda_extension\n\n\n"
    "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
    "    def forward(self, x):\n        return cuda_extension.log1m(x)\n"), **KERNELS}

SEED = 20261207  # fixed trials: the verdicts below are the same on every run


def task_file(tmp_path: Path, text: str, name: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def test_a_correct_loss_kernel_passes_and_the_distribution_trials_decide(tmp_path: Path) -> None:
    res = run(tmp_path, task_file(tmp_path, MSE_TASK, "mse_loss"), mse_solution(0), seed=SEED)
    assert res.status == "ok", res.message
    # the loss of two torch.rand tensors is 1/6 to within the tolerance on every draw
    assert R.FLAG_BARELY_VARIES in res.flags and "decided" in res.message, res.message
    assert [t["distribution"] for t in res.trial_inputs] == [""] * 5 + list(D.DISTRIBUTIONS)
    assert res.trials == res.trials_passed == 8 and [t["seed"] for t in res.trial_inputs] == res.seeds[1:]
    assert not any(t["skipped"] for t in res.trial_inputs)


@pytest.mark.parametrize("mode, what", [(1, "constant"), (2, "analytical formula"), (3, "sampled elements")])
def test_kernels_that_ignore_their_inputs_fail_a_distribution_trial(tmp_path: Path, mode: int, what: str) -> None:
    res = run(tmp_path, task_file(tmp_path, MSE_TASK, "mse_loss"), mse_solution(mode), seed=SEED)
    assert res.status == "incorrect" and res.trials_passed >= 5, (what, res.message)
    assert "inputs from the " in res.message and any(d in res.message for d in D.DISTRIBUTIONS), res.message
    assert res.rule in (rules.VALUES, rules.RELATIVE_ERROR), res.rule


@pytest.mark.parametrize("check", ["", RAISES], ids=["not-finite", "raises"])
def test_distributions_the_task_is_not_defined_on_are_skipped(tmp_path: Path, check: str) -> None:
    task = task_file(tmp_path, LOG_TASK.replace("{check}", check), "log1m_" + ("raises" if check else "nan"))
    res = run(tmp_path, task, LOG, seed=SEED)
    skipped = [t for t in res.trial_inputs if t["skipped"]]
    assert res.status == "ok", res.message
    assert [t["distribution"] for t in skipped] == ["normal", "heavy-tailed"], res.trial_inputs
    assert "2 skipped" in res.message, res.message
    why = "raised ValueError" if check else "not finite"
    assert all(why in t["skipped"] for t in skipped), skipped
    assert res.trials_passed == 8 - len(skipped)


def test_a_kernel_right_on_the_trials_and_constant_when_timed_fails(tmp_path: Path) -> None:
    # the constant passes every timed call on the task's own inputs; the timed calls also
    # rotate through the distribution trials' inputs, where it does not
    res = prof(tmp_path, mse_solution(4), task_file(tmp_path, MSE_TASK, "mse_loss_timed"), seed=SEED)
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT, res.message


def test_only_continuous_floating_point_inputs_are_redrawn() -> None:
    ints, mask = torch.randint(0, 10, (64,)), torch.rand(64) > 0.5
    labels, one = torch.randint(0, 3, (64,)).float(), torch.tensor([2.5])
    unit, signed, positive = torch.rand(4096), torch.randn(4096), torch.rand(4096).exp()
    half = torch.randn(4096).half()
    inputs = [unit, signed, positive, half, ints, mask, labels, one, 7, 0.5]
    for kind in D.DISTRIBUTIONS:
        out = D.redistribute(inputs, kind, seed=11)
        again = D.redistribute(inputs, kind, seed=11)
        for x, y, z in zip(inputs, out, again, strict=True):
            if isinstance(x, torch.Tensor):
                assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(y, z), kind
        assert all(out[i] is inputs[i] for i in range(4, 10)), kind  # ints, bools, labels, one element, numbers
        assert all(not torch.equal(out[i], inputs[i]) for i in range(4)), kind
        assert float(out[2].min()) >= 0 and float(out[0].min()) >= 0, kind  # signs kept
        assert not torch.equal(out[1], D.redistribute(inputs, kind, seed=12)[1])
    assert float(D.redistribute(inputs, "scaled", 3)[0].max()) <= 1.0  # [0, 1] kept where it is scaled
    heavy = D.redistribute([torch.randn(1 << 16)], "heavy-tailed", 5)[0]
    assert float(heavy.abs().max()) > 20 * float(heavy.std()) / 4  # far values a sample would miss
    with pytest.raises(ValueError, match="unknown input distribution"):
        D.redistribute(inputs, "cauchy", 1)


def test_barely_varies_is_the_test_datagen_applies() -> None:
    assert D.barely_varies([torch.tensor(1 / 6), torch.tensor(0.168)], 1e-2, 1e-2)
    assert not D.barely_varies([torch.tensor(1 / 6), torch.tensor(0.2)], 1e-2, 1e-2)
    assert not D.barely_varies([torch.tensor(1.0)], 1e-2, 1e-2)  # one output says nothing
