"""`cuda-agent bench` on the CPU backend: a small suite with correct, incorrect, slow and
missing solutions; metrics and report; resume after a kill; the evaluation service (started
for the run, or running) beside Ray."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cuda_agent.bench.jobs import BenchConfig
from cuda_agent.bench.metrics import metrics
from cuda_agent.bench.records import ResultsFile
from cuda_agent.bench.runner import run_bench
from cuda_agent.bench.suite import load_suite

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DATA = REPO / "tests" / "tasks" / "data"
AXPBY_SOL = EXAMPLES / "solutions" / "axpby_cpu"


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    tasks, sols = root / "suite", root / "solutions"
    (tasks / "level1").mkdir(parents=True)
    (tasks / "level2").mkdir()
    shutil.copy(EXAMPLES / "tasks" / "axpby.py", tasks / "level1" / "1_axpby.py")
    shutil.copy(DATA / "19_ReLU.py", tasks / "level1" / "19_ReLU.py")
    shutil.copy(DATA / "23_Softmax.py", tasks / "level1" / "23_Softmax.py")  # no solution: a failure
    shutil.copy(EXAMPLES / "tasks" / "axpby.py", tasks / "level2" / "2_axpby_slow.py")
    shutil.copytree(AXPBY_SOL, sols / "1_axpby")  # correct
    wrong = sols / "19_ReLU"  # computes max(x, 0) + 1: incorrect
    (wrong / "kernels").mkdir(parents=True)
    (wrong / "model_new.py").write_text("import torch.nn as nn\n\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
                                        "    def __init__(self):\n        super().__init__()\n\n"
                                        "    def forward(self, x):\n        return cuda_extension.axpby(x, x, 0.0)\n")
    for f in (AXPBY_SOL / "kernels").iterdir():
        shutil.copy(f, wrong / "kernels" / f.name)
    slow = sols / "level2" / "2_axpby_slow"  # correct, 40 times the work
    shutil.copytree(AXPBY_SOL, slow)
    (slow / "model_new.py").write_text((AXPBY_SOL / "model_new.py").read_text().replace(
        "        return cuda_extension.axpby(a, b, self.alpha)",
        "        out = None\n        for _ in range(40):\n            out = cuda_extension.axpby(a, b, self.alpha)\n"
        "        return out"))
    assert "range(40)" in (slow / "model_new.py").read_text()
    return tasks, sols


def test_bench_records_metrics_and_report(suite: tuple[Path, Path], tmp_path: Path) -> None:
    tasks, sols = suite
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "bench", str(tasks), "--solutions", str(sols),
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = {r.task_name: r for r in ResultsFile(out / "results.jsonl").read()}
    assert set(recs) == {"1_axpby", "19_ReLU", "23_Softmax", "2_axpby_slow"}
    assert recs["1_axpby"].status == "ok" and recs["1_axpby"].reward >= 1 and recs["1_axpby"].speedup_vs_compile
    assert recs["19_ReLU"].status == "incorrect" and recs["19_ReLU"].reward == -1
    assert recs["23_Softmax"].status == "missing" and not recs["23_Softmax"].correct
    slow = recs["2_axpby_slow"]
    assert slow.status == "ok" and slow.reward == 1.0 and slow.speedup_vs_eager < 0.5
    assert {r.level for r in recs.values()} == {"level1", "level2"}
    m = json.loads((out / "metrics.json").read_text())
    assert m["overall"]["pass_rate"] == 0.5 and m["level2"]["pass_rate"] == 1.0
    assert m["overall"]["statuses"] == {"incorrect": 1, "missing": 1, "ok": 2}
    s1, s2 = recs["1_axpby"].speedup_vs_compile, slow.speedup_vs_compile
    assert m["overall"]["geomean_vs_compile"] == pytest.approx((s1 * s2) ** 0.5, rel=1e-3)
    assert m["overall"]["geomean_vs_compile_all"] == pytest.approx((s1 * s2) ** 0.25, rel=1e-3)
    md = (out / "report.md").read_text()
    assert "| Level | Tasks | Pass rate |" in md and "| overall | 4 | 50.0% |" in md and "2_axpby_slow" in md
    page = (out / "report.html").read_text()
    assert "<table>" in page and "fast_p.png" in page
    assert (out / "fast_p.png").stat().st_size > 1000 and (out / "speedups.png").stat().st_size > 1000
    assert "pass 50.0%" in p.stdout


def test_resume_after_a_kill_and_ray_gives_the_same_records(suite: tuple[Path, Path], tmp_path: Path) -> None:
    tasks, sols = suite
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cuda_agent.cli", "bench", str(tasks), "--solutions", str(sols), "--device", "cpu",
           "--no-profile", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    results = out / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (results.exists() and results.read_text().count("\n") >= 1):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = ResultsFile(results).read()
    assert 1 <= len(first) < 4
    again = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = ResultsFile(results).read()
    assert sorted(r.task_name for r in lines) == ["19_ReLU", "1_axpby", "23_Softmax", "2_axpby_slow"]  # each once
    assert lines[0].to_dict() == first[0].to_dict()  # finished work was kept, not redone
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    local = {r.key: (r.status, r.correct, r.reward, r.rule) for r in lines}
    cfg = BenchConfig(device="cpu", workers=2, ray_address="local", eval_options={"profile": False})
    ray_recs = run_bench(load_suite(tasks), tmp_path / "ray", solutions=sols, cfg=cfg)
    assert {r.key: (r.status, r.correct, r.reward, r.rule) for r in ray_recs} == local
    assert {r.worker for r in ray_recs} <= {"ray-cpu0", "ray-cpu1"} and metrics(ray_recs)["pass_rate"] == 0.5

    # and through a running evaluation service, over HTTP
    from cuda_agent.serve.engine import Engine, ServiceConfig
    from cuda_agent.serve.http import Server

    server = Server(Engine(ServiceConfig(device="cpu")).start()).start()
    try:
        cfg = BenchConfig(device="cpu", service_url=server.url, eval_options={"profile": False})
        served = run_bench(load_suite(tasks), tmp_path / "served", solutions=sols, cfg=cfg)
    finally:
        server.close(grace_s=0)
    assert {r.key: (r.status, r.correct, r.reward, r.rule) for r in served} == local
    assert {r.worker for r in served if r.status != "missing"} == {"cpu0"}


def test_agent_episodes_share_the_pool(suite: tuple[Path, Path], tmp_path: Path) -> None:
    # Two episodes at once on one device slot (evaluations take turns); a replayed agent that
    # looks around and finishes without writing kernels: each task is scored (and fails).
    tasks, _ = suite
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"tool_calls": [{"name": "bash", "arguments": {"command": "ls kernels; head -1 model.py"}}]},
                                  {"tool_calls": [{"name": "finish", "arguments": {"summary": "nothing"}}]}]))
    only = tmp_path / "two"
    (only / "level1").mkdir(parents=True)
    for name in ("1_axpby.py", "19_ReLU.py"):
        shutil.copy(tasks / "level1" / name, only / "level1" / name)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "cuda_agent.cli", "bench", str(only), "--agent", "--replay", str(script),
                        "--episodes-per-device", "2", "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = ResultsFile(out / "results.jsonl").read()
    assert sorted(r.task_name for r in recs) == ["19_ReLU", "1_axpby"]
    for r in recs:
        assert not r.correct and r.reward == -1.0 and "finish after 2 turns" in r.message
        assert Path(r.trajectory).is_file()
    assert 'href="episodes/level1/' in (out / "report.html").read_text()
