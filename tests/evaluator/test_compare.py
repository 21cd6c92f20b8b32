"""The output comparison: its few-pass path for the usual case agrees with an element-by-element
reading of the rule, and every non-finite case reaches the full diagnosis."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.compare import REL_NORM, compare_outputs, compare_tensors, few_threads

INF, NAN = math.inf, math.nan


def _rule_by_element(exp: list[float], got: list[float], atol: float, rtol: float) -> str | None:
    """The rule, one element at a time: NaN and +-Inf where the reference has them, and
    |exp - got| <= atol + rtol * |exp| where both are finite."""
    for e, g in zip(exp, got, strict=True):
        if math.isnan(e) != math.isnan(g) or (e == INF) != (g == INF) or (e == -INF) != (g == -INF):
            return rules.NONFINITE
    for e, g in zip(exp, got, strict=True):
        if math.isfinite(e) and math.isfinite(g) and abs(e - g) > atol + rtol * abs(e):
            return rules.VALUES
    # and, over the finite pairs, the error's norm within REL_NORM of the reference's
    pairs = [(e, g) for e, g in zip(exp, got, strict=True) if math.isfinite(e) and math.isfinite(g)]
    ref = math.sqrt(sum(e * e for e, _ in pairs))
    if ref > 0 and math.sqrt(sum((e - g) ** 2 for e, g in pairs)) > REL_NORM * ref:
        return rules.RELATIVE_ERROR
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_random_cases_agree_with_the_rule_element_by_element(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    specials = [INF, -INF, NAN, 0.0, 1e30 if dtype != torch.float16 else 6e4]
    for _ in range(400):
        n = rng.randint(1, 6)
        exp = [rng.choice(specials) if rng.random() < 0.15 else rng.uniform(-3, 3) for _ in range(n)]
        got = []
        for e in exp:
            r = rng.random()
            got.append(rng.choice(specials) if r < 0.1 else e if r < 0.5 else
                       e + rng.uniform(-0.02, 0.02) if math.isfinite(e) else e)
        et, gt = torch.tensor(exp, dtype=dtype), torch.tensor(got, dtype=dtype)
        want = _rule_by_element(et.double().tolist(), gt.double().tolist(), 1e-2, 1e-2)
        m = compare_tensors("out", et, gt, 1e-2, 1e-2)
        assert (m.rule if m else None) == want, (exp, got, m)


def test_inf_in_the_reference_is_not_matched_by_a_finite_value() -> None:
    # the reference's Inf gives an infinite tolerance there; a finite answer must still fail
    m = compare_tensors("out", torch.tensor([1.0, INF]), torch.tensor([1.0, 5.0]), 1e-2, 1e-2)
    assert m is not None and m.rule == rules.NONFINITE and "lacks +Inf at index (1,)" in m.message
    assert compare_tensors("out", torch.tensor([INF, -INF, NAN]), torch.tensor([INF, -INF, NAN]), 0, 0) is None


def test_an_overflowing_difference_is_still_judged() -> None:
    big = torch.tensor([1.7e308, -1.7e308], dtype=torch.float64)
    m = compare_tensors("out", big, -big, 1e-2, 1e-2)
    assert m is not None and m.rule == rules.VALUES and "2 of 2 elements" in m.message
    assert compare_tensors("out", big, big.clone(), 0, 0) is None


def test_large_outputs_name_the_first_mismatch_and_the_count() -> None:
    exp = torch.randn(256, 4096)
    got = exp.clone()
    assert compare_outputs(exp, got, 1e-2, 1e-2) is None
    got[3, 5] += 1.0
    got[200, 7] -= 1.0
    m = compare_outputs((exp,), (got,), 1e-2, 1e-2)
    assert m is not None and m.rule == rules.VALUES
    assert m.message.startswith("output[0] mismatch at index (3, 5)") and "2 of 1048576 elements" in m.message


def test_the_inputs_are_left_as_they_were() -> None:
    exp, got = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    e0, g0 = exp.clone(), got.clone()
    compare_tensors("out", exp, got, 1e-2, 1e-2)
    compare_tensors("out", exp, exp.clone(), 1e-2, 1e-2)
    assert torch.equal(exp, e0) and torch.equal(got, g0)


def test_comparisons_use_few_threads_and_restore_the_count() -> None:
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    seen: list[int] = []
    with few_threads():
        seen.append(torch.get_num_threads())
    assert seen[0] == max(1, min(before, cores // 4, 4))
    assert torch.get_num_threads() == before
    torch.set_num_threads(max(1, before))
    # restored also when the comparison raises
    with pytest.raises(RuntimeError), few_threads():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_an_output_that_ignores_a_reference_smaller_than_atol_fails() -> None:
    """A wide softmax's values are all below atol: zeros, or a constant, pass element by
    element but not against the reference's own size; ordinary rounding passes."""
    x = torch.randn(16, 32768, generator=torch.Generator().manual_seed(0))
    exp = torch.softmax(x, dim=1)
    assert float(exp.max()) < 1e-2
    for wrong in (torch.zeros_like(exp), torch.full_like(exp, 1 / 32768)):
        m = compare_tensors("output", exp, wrong, 1e-2, 1e-2)
        assert m is not None and m.rule == rules.RELATIVE_ERROR and "reference's own size" in m.message
    assert compare_tensors("output", exp, exp.half().float(), 1e-2, 1e-2) is None  # fp16 arithmetic
    assert compare_tensors("output", exp, torch.softmax(x.double(), 1).float(), 1e-2, 1e-2) is None
    # a small result of a large cancellation, computed in another order: still close enough
    big = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e3
    small = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e-3
    exp = ((big + small) - big).double()
    assert compare_tensors("output", exp.float(), ((big.double() + small.double()) - big.double()).float(),
                           1e-2, 1e-2) is None
    assert compare_tensors("output", torch.zeros(8), torch.full((8,), 1e-3), 1e-2, 1e-2) is None  # no scale
