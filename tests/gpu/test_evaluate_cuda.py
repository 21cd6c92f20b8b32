"""The evaluator on a real GPU: correct CUDA kernels and the CUDA cheat patterns."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
from cuda_agent.evaluator.solution import load_solution
from cuda_agent.tasks import load_task_file

from . import cases_cuda as C

pytestmark = pytest.mark.gpu


def run(tmp_path: Path, task: Path, files: dict[str, str], **opts):  # type: ignore[no-untyped-def]
    for rel, text in files.items():
        p = tmp_path / "solution" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    target = tmp_path / "solution" / ("model_new.py" if len(files) == 1 else "")
    opts.setdefault("profile", False)  # speed is tested in test_profile_cuda.py
    res = evaluate(load_task_file(task), load_solution(target), EvalOptions(device="cuda", **opts))
    print(f"\n{task.stem}: {res.status} rule={res.rule} timings={res.timings_s}\n  {res.message[:300]}")
    for proc in ("reference", "candidate"):  # where each process's time went
        print(f"  {proc} phases (s since start): {res.details.get(f'{proc}_phases_s')}")
    return res


@pytest.mark.parametrize(
    "task, files",
    [
        (C.AXPBY_TASK, C.AXPBY),
        (C.RELU_TASK, C.RELU),
        (C.LINEAR_RELU_TASK, C.LINEAR_RELU),
        (C.SOFTMAX_TASK, {"model_new.py": C.SOFTMAX_SINGLE_FILE}),
    ],
    ids=["axpby", "relu", "linear_relu_cublas", "softmax_load_inline"],
)
def test_correct_cuda_solutions_pass(tmp_path: Path, task: Path, files: dict[str, str]) -> None:
    res = run(tmp_path, task, files)
    assert res.status == "ok", res.message
    assert res.device == "cuda" and res.correct and res.reward == 1.0


@pytest.mark.parametrize("name", sorted(C.CHEATS))
def test_cuda_cheats_fail(tmp_path: Path, name: str) -> None:
    files, status, rule = C.CHEATS[name]
    res = run(tmp_path, C.AXPBY_TASK, files, static_checks=False)
    assert res.status == status, res.message
    if rule:
        assert res.rule == rule, res.message


def test_functional_fallback_rejected(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, C.F_FALLBACK, static_checks=False)
    assert res.status == "rejected" and res.rule == "functional-call"
    res = run(tmp_path / "static", C.AXPBY_TASK, C.F_FALLBACK)
    assert res.status == "rejected" and res.rule == "functional-call"


def test_illegal_memory_access_then_next_evaluation_works(tmp_path: Path) -> None:
    files = dict(C.AXPBY)
    files["kernels/axpby.cu"] = files["kernels/axpby.cu"].replace(
        "out[i] = make_float4", "out[i + (int64_t(1) << 40)] = make_float4")
    res = run(tmp_path / "bad", C.AXPBY_TASK, files)
    assert res.status == "runtime_error"
    assert "illegal" in res.message.lower() or "cuda error" in res.message.lower()
    assert run(tmp_path / "good", C.AXPBY_TASK, C.AXPBY).status == "ok"


def test_hung_kernel_times_out(tmp_path: Path) -> None:
    files = dict(C.AXPBY)
    files["kernels/axpby.cu"] = files["kernels/axpby.cu"].replace(
        "for (; i < n4; i += stride) {", "long long t0 = clock64();\n  while (clock64() - t0 >= 0) { }\n  for (; i < n4; i += stride) {")
    res = run(tmp_path, C.AXPBY_TASK, files, run_timeout_s=30.0)
    assert res.status == "timeout"
