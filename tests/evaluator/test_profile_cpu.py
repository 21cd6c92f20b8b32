"""Profiling on the CPU backend: speedups and rewards from real timings, the baseline
cache, and cheats that must not win a reward."""

from __future__ import annotations

import json
from pathlib import Path

from cuda_agent.evaluator import record as R
from cuda_agent.evaluator import rules, timing
from cuda_agent.evaluator.reward import DEFAULT_THRESHOLD
from cuda_agent.paths import cache_dir
from cuda_agent.tasks import compute_task_id

from . import cases as C
from .test_evaluate_cpu import run

FAST = timing.Protocol(warmup=3, min_iters=10, max_iters=200, target_rel_ci=0.02, budget_s=1.0)


def prof(tmp_path: Path, files: dict[str, str], task: Path = C.AXPBY_TASK, **opts):  # type: ignore[no-untyped-def]
    return run(tmp_path, task, files, profile=True, protocol=FAST, **opts)


def own_task(tmp_path: Path, tag: str) -> Path:
    """The axpby task under an id of its own: its baseline entries are this test's alone
    (xdist's workers share one cache, and some tests rewrite or re-measure entries)."""
    task = tmp_path / f"axpby_{tag}.py"
    task.write_text(C.AXPBY_TASK.read_text() + f"\n# {tag}\n")
    return task


def entries(task: Path) -> list[Path]:
    """The baseline cache's entries of `task`."""
    tid = compute_task_id(task.read_text())
    return [f for f in cache_dir("baselines").glob("*.json") if json.loads(f.read_text())["key"]["task_id"] == tid]


def expected_milestone(res: R.EvalResult) -> float:
    t = DEFAULT_THRESHOLD
    eager = res.speedup_vs_eager is not None and 1 - 1 / res.speedup_vs_eager > t
    both = eager and res.speedup_vs_compile is not None and 1 - 1 / res.speedup_vs_compile > t
    return 3.0 if both else 2.0 if eager else 1.0


def test_profiled_solution_has_times_speedups_and_reward(tmp_path: Path) -> None:
    task = own_task(tmp_path, "profiled")
    res = prof(tmp_path / "a", C.axpby(), task)
    assert res.status == "ok", res.message
    assert res.details["baseline"] == "measured"
    assert set(res.times_us) >= {"candidate", "eager", "compile"}
    for t in res.times_us.values():
        assert 0 < t["min_us"] <= t["median_us"] <= t["max_us"] and t["iterations"] >= 10
    assert res.speedup_vs_eager and res.speedup_vs_compile and res.wall_speedup_vs_eager
    assert res.reward == expected_milestone(res)
    assert "profile" in res.timings_s and res.details["threads"] >= 1
    for who in ("candidate", "baseline"):  # where each timing process's time went
        spent = res.details[f"{who}_measure_s"]
        assert set(spent) == {"warm-up", "rounds", "rounds_n", "round_parts", "calls_s", "checks"} \
            and spent["rounds_n"] >= 10, spent
        # the rounds' parts are within the rounds; the timed calls, summed per subject, are one part
        assert 0 < sum(spent["round_parts"].values()) <= spent["rounds"], spent
        assert abs(sum(spent["calls_s"].values()) - spent["round_parts"]["calls"]) < 1e-3, spent
    assert res.details["candidate_measure_s"]["rounds"] < res.timings_s["profile"]
    # when each step of the evaluation ended: in order, the baselines measured before the
    # candidate's end (its timing waited for them), all within the evaluation's total
    steps = res.details["evaluator_phases_s"]
    assert list(steps) == ["static checks", "reference started", "built", "baselines planned", "trials checked",
                           "baselines measured", "candidate ended", "reference ended", "outputs checked",
                           "speed judged"], steps
    assert res.details["profile_gate"] == "go"
    # (marks are rounded to 0.1 ms, timings_s to 1 ms)
    assert list(steps.values()) == sorted(steps.values()) and steps["speed judged"] <= res.timings_s["total"] + 6e-4
    assert steps["candidate ended"] - steps["baselines measured"] >= res.details["candidate_measure_s"]["rounds"] - 2e-4
    again = prof(tmp_path / "b", C.axpby(), task, drift_bound=10.0)  # CPU timing noise must not re-measure here
    assert again.details["baseline"] == "cached" and "baseline" not in again.timings_s
    assert "baseline_measure_s" not in again.details
    assert again.times_us["compile"] == res.times_us["compile"]  # the cached numbers
    assert "baselines measured" not in again.details["evaluator_phases_s"]


def test_a_wrong_solution_is_answered_without_its_profile(tmp_path: Path) -> None:
    # The candidate gets the device for its timing only once its trials were found right;
    # the trials are checked again at the end, and the verdict is the same as without.
    task = own_task(tmp_path, "wrong_unprofiled")
    assert prof(tmp_path / "a", C.axpby(), task).status == "ok"  # (the baselines cached)
    kernel = C.AXPBY_KERNELS["kernels/axpby.cpp"].replace("alpha * a[i] + b[i]", "alpha * a[i] - b[i]")
    wrong = prof(tmp_path / "b", C.axpby(axpby__cpp=kernel), task)
    assert wrong.status == "incorrect" and "trial 1 of" in wrong.message, wrong.message
    assert wrong.details["profile_gate"].startswith("cancelled") and "profile" not in wrong.timings_s
    assert "profile" not in wrong.details["candidate_phases_s"] and not wrong.times_us
    right = prof(tmp_path / "c", C.axpby(), task, drift_bound=10.0)
    assert right.status == "ok" and right.details["profile_gate"] == "go" and right.speedup_vs_compile
    assert "trials checked" in right.details["evaluator_phases_s"]


def test_slow_kernel_is_correct_but_earns_only_one(tmp_path: Path) -> None:
    slow = C.forward("out = None\nfor _ in range(40):\n    out = cuda_extension.axpby(a, b, self.alpha)\nreturn out")
    res = prof(tmp_path, C.axpby(slow))
    assert res.status == "ok" and res.correct, res.message
    assert res.speedup_vs_eager < 0.5 and res.reward == 1.0


def test_faster_than_eager_only_earns_two(tmp_path: Path) -> None:
    # Three passes over memory (and three new outputs) where eager makes twelve and
    # torch.compile one: 3.4-4.1x eager and 0.35-0.46x torch.compile here, one thread each.
    # A neighbouring test that loads the machine while the candidate is timed, and not
    # while the baselines were, at most halves a one-thread candidate's share of a core
    # (speedups are only ever scaled down). With a thread per core, a parallel region waits
    # for its slowest thread, and that can be one the neighbour preempted: in CI, 1.06x
    # eager and 0.13x torch.compile.
    res = run(tmp_path, C.CHAIN_TASK, C.chain(passes=3), profile=True, protocol=FAST, threads=1)
    assert res.status == "ok", res.message
    assert res.speedup_vs_eager > 1.1 and res.speedup_vs_compile < 0.9, (res.speedup_vs_eager, res.speedup_vs_compile)
    assert res.reward == 2.0


def test_drifted_baseline_or_a_changed_probe_measures_the_baselines_again(tmp_path: Path) -> None:
    task = own_task(tmp_path, "drifted")
    first = prof(tmp_path / "a", C.axpby(), task)
    assert first.status == "ok", first.message
    # the cached eager time 5x what it was, as if measured on a much slower machine
    inflated = {}
    for path in entries(task):
        data = json.loads(path.read_text())
        assert data["extra"]["probe"]["device"]["median_us"] > 0  # the baseline process timed the probe
        data["eager"]["device"]["median_us"] *= 5
        inflated[path] = data["eager"]["device"]["median_us"]
        path.write_text(json.dumps(data))
    res = prof(tmp_path / "b", C.axpby(), task)
    assert inflated and R.FLAG_REMEASURED in res.flags and res.details["baseline"] == "measured"
    # the inflated eager time was not used: the verdict's is the one measured again and cached
    used = res.times_us["eager"]["median_us"]
    stored = [json.loads(p.read_text())["eager"]["device"]["median_us"] for p in inflated]
    assert used not in inflated.values() and any(abs(used - x) <= 0.01 * x for x in stored), (used, stored)
    assert res.details["scaled_by"] == "probe" and set(res.details["probe_us"]) == {"beside_candidate",
                                                                                   "beside_baselines"}
    # the device probe cached 4x what it is now (the device ran 4x slower back then)
    for path in entries(task):
        data = json.loads(path.read_text())
        data["extra"]["probe"]["device"]["median_us"] *= 4
        path.write_text(json.dumps(data))
    res = prof(tmp_path / "c", C.axpby(), task)
    assert R.FLAG_REMEASURED in res.flags and res.details["baseline"] == "measured", res.flags


def test_output_cache_keyed_by_pointer_does_not_win(tmp_path: Path) -> None:
    cheat = C.forward(
        "key = (a.data_ptr(), b.data_ptr(), tuple(a.shape))\n"
        "if key not in self.memo:\n    self.memo[key] = cuda_extension.axpby(a, b, self.alpha)\n"
        "return self.memo[key].clone()", init="        self.memo = {}")
    res = prof(tmp_path, C.axpby(cheat), static_checks=False)
    assert res.status == "incorrect" and not res.correct and res.reward == -1.0, res.message


def test_output_memo_keyed_by_content_gains_nothing(tmp_path: Path) -> None:
    # Slow on a miss, free on a hit: timed calls never see the same values twice, so it stays slow.
    cheat = C.forward(
        "key = (a.numpy().tobytes(), b.numpy().tobytes())\n"
        "if key not in self.memo:\n"
        "    for _ in range(40):\n        out = cuda_extension.axpby(a, b, self.alpha)\n"
        "    self.memo[key] = out\n"
        "return self.memo[key].clone()", init="        self.memo = {}")
    res = prof(tmp_path, C.axpby(cheat), static_checks=False)
    assert res.status == "ok" and res.correct, res.message
    assert res.speedup_vs_eager < 0.5 and res.reward == 1.0


def test_uninitialised_output_after_verification_is_incorrect(tmp_path: Path) -> None:
    # Computes during the verification trials, then returns fresh memory, hoping it holds an
    # earlier right answer: outputs let go are poisoned and check calls see the difference.
    cheat = C.forward(
        "self.calls += 1\n"
        f"if self.calls <= {C.TRIALS}:\n    return cuda_extension.axpby(a, b, self.alpha)\n"
        "return torch.empty_like(a)", init="        self.calls = 0")
    res = prof(tmp_path, C.axpby(cheat), static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.TIMED_OUTPUT and res.reward == -1.0, res.message


def test_patched_clock_changes_nothing(tmp_path: Path) -> None:
    cheat = C.forward("return cuda_extension.axpby(a, b, self.alpha)",
                      imports="import time\ntime.perf_counter_ns = lambda: 0\ntime.perf_counter = lambda: 0.0")
    res = prof(tmp_path, C.axpby(cheat), static_checks=False)
    assert res.status == "ok", res.message
    assert res.times_us["candidate"]["median_us"] > 0 and res.speedup_vs_eager < 50


def test_failed_torch_compile_is_flagged_explained_and_never_cached(tmp_path: Path) -> None:
    # A task that eager runs and torch.compile cannot: its compile baseline is eager, the
    # record says why, and that stand-in is not cached for later evaluations.
    task = tmp_path / "axpby_uncompilable.py"
    # (inductor's C++ compiler pointed at nothing: its CPU code generation fails every time)
    task.write_text(C.AXPBY_TASK.read_text().replace(
        "import torch.nn as nn\n",
        "import torch.nn as nn\nimport torch._inductor.config\n\n"
        "torch._inductor.config.cpp.cxx = ('/nonexistent/refuses-to-compile',)\n", 1))
    res = run(tmp_path / "sol", task, C.axpby(), profile=True, protocol=FAST)
    assert res.status == "ok", res.message
    assert R.FLAG_COMPILE_FAILED in res.flags
    assert "refuses-to-compile" in res.details["compile_error"] and "torch.compile failed" in res.message
    assert "refuses-to-compile" in res.details["compile_retried"]  # tried again in a fresh process first
    assert entries(task) == []  # an eager-only baseline is not cached: the next evaluation measures again


# Eager runs it; torch.compile compiles it, matches eager, then fails from its third call on
# (a stand-in for a compiled module that breaks when the timing loop gives it new buffers).
BREAKS_WHEN_TIMED = """import sys
import torch
import torch.nn as nn

_compiled_calls = [0]


@torch.compiler.disable
def _probe(x):
    # Called from eager, one frame of torch/_dynamo/eval_frame.py is on the stack (this
    # function's disable wrapper); called from the compiled module, more (its wrappers).
    frames, f = 0, sys._getframe(1)
    while f is not None:
        frames += f.f_code.co_filename.replace("\\\\", "/").endswith("_dynamo/eval_frame.py")
        f = f.f_back
    if frames > 1:
        _compiled_calls[0] += 1
        if _compiled_calls[0] > 2:
            raise RuntimeError("compiled module breaks after warm-up")
    return x


class Model(nn.Module):
    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _probe(self.alpha * a) + b


def get_inputs():
    return [torch.randn(256, 4096), torch.randn(256, 4096)]


def get_init_inputs():
    return [2.0]
"""


def test_compiled_module_failing_while_timed_leaves_an_eager_baseline(tmp_path: Path) -> None:
    task = tmp_path / "axpby_breaks_when_timed.py"
    task.write_text(BREAKS_WHEN_TIMED)
    res = run(tmp_path / "sol", task, C.axpby(), profile=True, protocol=FAST)
    assert res.status == "ok" and res.reward is not None and res.reward >= 1, res.message
    assert R.FLAG_COMPILE_FAILED in res.flags and R.FLAG_NOT_PROFILED not in res.flags
    err = res.details["compile_error"]
    assert "failed while timed" in err and "breaks after warm-up" in err, err
    assert res.speedup_vs_compile == res.speedup_vs_eager  # eager stands in for torch.compile
    assert entries(task) == []  # an eager-only baseline is not cached


def test_concurrent_baselines_each_compile(tmp_path: Path) -> None:
    # Two evaluations measuring baselines at once (bench workers, xdist) used to share one
    # torch.compile cache; as root each sandbox run owns its writable trees, so one run's
    # inductor writes failed (EACCES) under the other's ownership. Each run has its own now.
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> R.EvalResult:
        return prof(tmp_path / str(i), C.axpby(), baseline_cache=False)

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, range(2)))
    for res in results:
        assert res.status == "ok", res.message
        assert R.FLAG_COMPILE_FAILED not in res.flags, res.details.get("compile_error")
        assert res.speedup_vs_compile is not None
        assert res.details["baseline_measure_s"]["rounds_n"] >= 10  # measured, not cached
