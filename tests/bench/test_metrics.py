"""Suite metrics against hand-computed values, and solution matching by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cuda_agent.bench.metrics import by_level, metrics
from cuda_agent.bench.records import BenchRecord, ResultsFile, latest
from cuda_agent.bench.suite import Entry, find_solution
from cuda_agent.tasks import task_from_code


def rec(name: str, level: str, status: str, reward: float, se: float | None = None, sc: float | None = None,
        flags: tuple[str, ...] = ()) -> BenchRecord:
    return BenchRecord(key=f"{level}/{name}", task_id=name, task_name=name, level=level, status=status,
                       correct=status == "ok", reward=reward, speedup_vs_eager=se, speedup_vs_compile=sc,
                       flags=list(flags))


RECORDS = [
    rec("a", "level1", "ok", 3.0, se=4.0, sc=2.0),
    rec("b", "level1", "ok", 2.0, se=1.5, sc=1.04, flags=("timing-ci-above-target",)),  # 4% faster: not "faster"
    rec("c", "level1", "ok", 1.0, se=0.5, sc=0.25),
    rec("d", "level2", "incorrect", -1.0),
    rec("e", "level2", "missing", -1.0),
]


def test_overall_metrics_match_hand_computed_values() -> None:
    m = metrics(RECORDS)
    assert m["tasks"] == 5 and m["correct"] == 3 and m["pass_rate"] == 0.6
    assert m["faster_than_eager"] == 0.4  # a, b (1.5 > 1/0.95); c is slower
    assert m["faster_than_compile"] == 0.2  # a only: b is 4% faster, under the 5% threshold
    assert m["faster_than_compile_no_threshold"] == 0.4  # a, b
    assert m["geomean_vs_eager"] == pytest.approx((4.0 * 1.5 * 0.5) ** (1 / 3), abs=1e-4)
    assert m["geomean_vs_compile"] == pytest.approx((2.0 * 1.04 * 0.25) ** (1 / 3), abs=1e-4)
    assert m["geomean_vs_compile_all"] == pytest.approx((2.0 * 1.04 * 0.25 * 1 * 1) ** (1 / 5), abs=1e-4)
    assert m["mean_vs_eager"] == pytest.approx(2.0) and m["median_vs_compile"] == pytest.approx(1.04)
    assert m["fast_p_vs_eager"]["0.0"] == 0.6 and m["fast_p_vs_eager"]["1.0"] == 0.4
    assert m["fast_p_vs_eager"]["2.0"] == 0.2 and m["fast_p_vs_compile"]["1.5"] == 0.2
    assert m["rewards"] == {"-1.0": 2, "1.0": 1, "2.0": 1, "3.0": 1}
    assert m["statuses"] == {"incorrect": 1, "missing": 1, "ok": 3}
    assert m["flags"] == {"timing-ci-above-target": 1}


def test_metrics_per_level() -> None:
    m = by_level(RECORDS)
    assert list(m) == ["level1", "level2", "overall"]
    assert m["level1"]["pass_rate"] == 1.0 and m["level2"]["pass_rate"] == 0.0
    assert m["level2"]["geomean_vs_compile"] is None and m["level2"]["geomean_vs_compile_all"] == 1.0
    assert math.isclose(m["level1"]["geomean_vs_eager"], (4.0 * 1.5 * 0.5) ** (1 / 3), abs_tol=1e-4)


def test_results_file_survives_a_torn_line_and_keeps_the_latest(tmp_path: Path) -> None:
    f = ResultsFile(tmp_path / "results.jsonl")
    f.append(RECORDS[0])
    with open(f.path, "a") as fh:
        fh.write('{"key": "level1/b", "sta')  # killed mid-write
    f.append(RECORDS[1])
    again = rec("a", "level1", "ok", 2.0, se=1.2, sc=1.01)
    f.append(again)
    got = latest(f.read())
    assert set(got) == {"level1/a", "level1/b"} and got["level1/a"].reward == 2.0


TASK = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.relu(x)\n\ndef get_inputs():\n    return [torch.randn(4)]\n\n"
        "def get_init_inputs():\n    return []\n")


def test_solutions_are_found_by_name_in_each_layout(tmp_path: Path) -> None:
    task = task_from_code(TASK, name="19_ReLU", source="x", level="level1")
    e = Entry(task, "level1")
    root = tmp_path / "sols"
    root.mkdir()
    assert find_solution(e, root) is None
    gen = root / "level_1_problem_19_sample_1_kernel.py"
    gen.write_text("x")
    (root / "level_2_problem_19_sample_0_kernel.py").write_text("x")  # another level
    assert find_solution(e, root) == gen
    first = root / "level_1_problem_19_sample_0_kernel.py"
    first.write_text("x")
    assert find_solution(e, root) == first  # the first sample
    single = root / "level1" / "19_ReLU.py"
    single.parent.mkdir()
    single.write_text("x")
    assert find_solution(e, root) == single
    ws = root / "19_ReLU"
    ws.mkdir()
    (ws / "model_new.py").write_text("x")
    assert find_solution(e, root) == ws
