"""`cuda-agent bench` on a real GPU: KernelBench-shape tasks with CUDA solutions, one
worker per GPU, report written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cuda_agent.bench.jobs import BenchConfig
from cuda_agent.bench.report import write_report
from cuda_agent.bench.runner import run_bench
from cuda_agent.bench.suite import load_suite

from . import cases_cuda as C

pytestmark = pytest.mark.gpu


def test_bench_cuda_suite(tmp_path: Path) -> None:
    import torch

    tasks, sols = tmp_path / "suite" / "level1", tmp_path / "solutions"
    tasks.mkdir(parents=True)
    cases = {"1_axpby": (C.AXPBY_TASK, C.AXPBY), "19_ReLU": (C.RELU_TASK, C.RELU),
             "76_Linear_ReLU": (C.LINEAR_RELU_TASK, C.LINEAR_RELU),
             "23_Softmax": (C.SOFTMAX_TASK, {"model_new.py": C.SOFTMAX_SINGLE_FILE}),
             "99_missing": (C.RELU_TASK, None)}
    for name, (task, files) in cases.items():
        shutil.copy(task, tasks / f"{name}.py")
        for rel, text in (files or {}).items():
            p = sols / name / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    gpus = list(range(torch.cuda.device_count()))
    cfg = BenchConfig(device="cuda", gpus=gpus)
    recs = run_bench(load_suite(tmp_path / "suite"), tmp_path / "out", solutions=sols, cfg=cfg)
    for r in sorted(recs, key=lambda r: r.task_name):
        print(f"{r.task_name:16s} {r.status:10s} reward {r.reward:4g} vs eager {r.speedup_vs_eager} "
              f"vs compile {r.speedup_vs_compile} worker {r.worker} gpu {r.gpu} {r.seconds:.1f}s flags {r.flags}")
    by = {r.task_name: r for r in recs}
    assert by["99_missing"].status == "missing"
    assert all(by[n].status == "ok" and by[n].reward >= 1 for n in cases if n != "99_missing")
    assert {r.gpu for r in recs if r.status != "missing"} <= set(gpus)
    md, _ = write_report(tmp_path / "out")
    print(md.read_text()[:1500])
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["overall"]["pass_rate"] == 0.8
