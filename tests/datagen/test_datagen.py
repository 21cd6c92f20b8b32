"""Training-data synthesis on the CPU: the catalogue, the composers, every filter, the
similarity measure, resume, the operator-count mix, and the files it writes."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cuda_agent.agent import OpenAIClient, OpenAIConfig
from cuda_agent.agent.scripted_server import ScriptedServer
from cuda_agent.datagen.catalog import catalogue, introspected_activations, usable
from cuda_agent.datagen.compose import (
    PUBLISHED_MIX,
    Composed,
    compose_llm,
    compose_offline,
    compose_transformers,
    normalised_mix,
    sample_n_ops,
)
from cuda_agent.datagen.pipeline import DatagenConfig, Generator, batch_variable, with_size
from cuda_agent.datagen.similarity import similarity
from cuda_agent.tasks import import_task_module, load_tasks, task_from_code

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "tasks" / "data"


def task(forward: str, init: str = "", shape: str = "16, 64") -> str:
    return ("import time\nimport torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
            f"    def __init__(self):\n        super().__init__()\n{init}\n"
            f"    def forward(self, x):\n{forward}\n\n\ndef get_inputs():\n    return [torch.randn({shape})]\n\n\n"
            "def get_init_inputs():\n    return []\n")


GOOD = task("        return torch.relu(x) * 2.0")
CASES = {
    "parse": "class Model:\n    pass\n",
    "stochastic": task("        return self.drop(x)", init="        self.drop = nn.Dropout(0.5)"),
    "runs": task("        return x @ x"),  # (16, 64) @ (16, 64): shapes do not match
    "deterministic": task("        return x * (time.perf_counter_ns() % 1000003 + 1)"),  # differs run to run
    "nontrivial": task("        return x * 0.0"),
    "compile": task("        self.calls += 1\n        return x * self.calls", init="        self.calls = 0"),
}
NONTRIVIAL = {
    "constant": task("        return torch.ones_like(x) * 3.0"),
    "input-independent": task("        return self.w.expand(16, 64) + 0 * x",
                              init="        self.w = nn.Parameter(torch.randn(1, 64))"),
    "nan": task("        return torch.log(x)"),
}


def run_one(tmp_path: Path, code: str, **cfg) -> dict:  # type: ignore[no-untyped-def]
    cfg.setdefault("min_ms", 0.0)
    g = Generator(DatagenConfig(n=1, **cfg), tmp_path / "out.jsonl")
    g.process_composed(0, Composed(code=code, ops=["x"], n_ops=1, data_source="torch#1", composer="test"))
    for path in (g.out, g.rejects):
        if path.exists():
            return {**json.loads(path.read_text().splitlines()[-1]), "accepted": path == g.out}
    raise AssertionError("no line written")


@pytest.mark.parametrize("stage", sorted(CASES))
def test_each_filter_rejects_a_task_built_to_fail_it(tmp_path: Path, stage: str) -> None:
    row = run_one(tmp_path, CASES[stage], compile_filter=stage == "compile", runtime_filter=False)
    assert not row["accepted"] and row["stage"] == stage, row.get("why")


@pytest.mark.parametrize("kind", sorted(NONTRIVIAL))
def test_trivial_outputs_are_rejected(tmp_path: Path, kind: str) -> None:
    row = run_one(tmp_path, NONTRIVIAL[kind], compile_filter=False, runtime_filter=False)
    assert not row["accepted"] and row["stage"] == "nontrivial", row.get("why")


def test_a_good_task_passes_every_filter_and_runtime_bounds_reject(tmp_path: Path) -> None:
    row = run_one(tmp_path / "a", GOOD, decontaminate=DATA)
    assert row["accepted"], row.get("why")
    f = row["filters"]
    assert set(f) >= {"parse", "stochastic", "duplicate", "decontaminate", "runs", "deterministic", "nontrivial",
                      "compile", "runtime"}
    assert row["eager_ms"] > 0 and row["compile_ms"] > 0 and f["decontaminate"]["max_similarity"] < 0.9
    slow = run_one(tmp_path / "b", GOOD, compile_filter=False, min_ms=1000.0)
    assert not slow["accepted"] and slow["stage"] == "runtime" and "outside" in slow["why"]
    # far outside the range, a quick timing rejects it before torch.compile is paid for
    early = run_one(tmp_path / "c", GOOD, min_ms=1000.0, calibrate=False)
    assert not early["accepted"] and early["stage"] == "runtime", early.get("why")
    assert "before torch.compile" in early["why"]


def test_timings_take_the_device_one_worker_at_a_time(tmp_path: Path) -> None:
    # The lock every timing holds (on CUDA by default): while another holder has it, the
    # task's timings wait, and the row says how long.
    import fcntl
    import threading

    from cuda_agent.paths import cache_dir

    lock = cache_dir("datagen-locks") / "datagen-cpu.lock"
    fh = open(lock, "a")
    fcntl.flock(fh, fcntl.LOCK_EX)
    inode = str(lock.stat().st_ino)

    def release_once_waited_for() -> None:
        deadline = time.monotonic() + 120
        # /proc/locks marks a process blocked on a lock with "->"
        while time.monotonic() < deadline and not any(
                "->" in line and line.split()[-3].endswith(":" + inode) for line in open("/proc/locks")):
            time.sleep(0.05)
        time.sleep(1.0)
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()

    threading.Thread(target=release_once_waited_for, daemon=True).start()
    row = run_one(tmp_path, GOOD, compile_filter=False, exclusive_timing=True)
    assert row["accepted"], row.get("why")
    assert row["device_wait_s"] >= 0.9 and row["eager_ms"] > 0
    free = run_one(tmp_path / "b", GOOD, compile_filter=False)  # CPU default: no lock
    assert "device_wait_s" not in free


def test_concurrent_locked_timings_share_the_lock(tmp_path: Path) -> None:
    # Two workers at once on one device lock: each runs as its own sandbox uid, and
    # neither may take the lock file from the other (it is bound read-only).
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        rows = list(ex.map(lambda i: run_one(tmp_path / str(i), GOOD, compile_filter=False,
                                             exclusive_timing=True), range(2)))
    assert all(r["accepted"] for r in rows), [r.get("why") for r in rows]
    assert all("device_wait_s" in r for r in rows)


SIZED = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
         "        super().__init__()\n\n    def forward(self, x):\n        return torch.tanh(x) * 2.0\n\n\n"
         "batch_size = 4\nfeatures = 1024\n\n\ndef get_inputs():\n    return [torch.randn(batch_size, features)]\n\n\n"
         "def get_init_inputs():\n    return []\n")


def test_batch_size_is_calibrated_into_the_runtime_range(tmp_path: Path) -> None:
    assert batch_variable(SIZED) == "batch_size" and batch_variable(GOOD) is None
    assert "batch_size = 96\nfeatures = 1024" in with_size(SIZED, "batch_size", 96)
    # 4 x 1024 elements take microseconds; [0.3, 30] ms needs hundreds of times more rows.
    row = run_one(tmp_path / "a", SIZED, compile_filter=False, min_ms=0.3, max_ms=30.0)
    assert row["accepted"], row.get("why")
    cal = row["filters"]["calibrate"]
    assert cal["var"] == "batch_size" and cal["from"] == 4 and cal["to"] >= 32, cal  # (how far: the machine's speed)
    assert f"batch_size = {cal['to']}\n" in row["code"] and 0.3 <= row["eager_ms"] <= 30.0
    assert row["task_id"] == task_from_code(row["code"], name="t").id
    assert import_task_module(task_from_code(row["code"], name="t")).get_inputs()[0].shape[0] == cal["to"]
    # the size cap holds: at most 1 MB of inputs cannot reach 30 ms, so the task is rejected
    capped = run_one(tmp_path / "b", SIZED, compile_filter=False, min_ms=30.0, max_ms=100.0, max_input_mb=1.0)
    assert not capped["accepted"] and capped["stage"] == "runtime"
    assert f"batch_size = {(1 << 20) // (4 * 1024)}\n" in capped["code"]
    kept = run_one(tmp_path / "c", SIZED, compile_filter=False, min_ms=0.3, max_ms=30.0, calibrate=False)
    assert not kept["accepted"] and "batch_size = 4\n" in kept["code"]


def test_duplicates_and_benchmark_copies_are_rejected(tmp_path: Path) -> None:
    g = Generator(DatagenConfig(n=2, compile_filter=False, runtime_filter=False, decontaminate=DATA),
                  tmp_path / "out.jsonl")
    copy = (DATA / "19_ReLU.py").read_text().replace("class Model", "class Model").replace("x", "inp")
    for i, code in enumerate([GOOD, GOOD, copy]):
        g.process_composed(i, Composed(code=code, ops=["x"], n_ops=1, data_source="torch#1", composer="test"))
    rejects = [json.loads(x) for x in g.rejects.read_text().splitlines()]
    assert [r["stage"] for r in rejects] == ["duplicate", "decontaminate"] and "19_ReLU" in rejects[1]["why"]
    assert " to 19_ReLU.py " in rejects[1]["why"], rejects[1]["why"]  # named within the benchmark, not by a path


def test_ast_similarity() -> None:
    a = (DATA / "76_Linear_ReLU.py").read_text()
    renamed = a.replace("self.linear", "self.fc").replace("x", "inp").replace('"""', '"""Another docstring. ', 1)
    assert similarity(a, a) == 1.0 and similarity(a, renamed) == 1.0
    assert similarity(a, (DATA / "23_Softmax.py").read_text()) < 0.5
    other_op = a.replace("torch.relu", "torch.sigmoid")
    assert 0.5 < similarity(a, other_op) < 1.0  # same structure, another operator


def test_catalogue_is_introspected_and_marks_stochastic_ops() -> None:
    names = {o.name for o in catalogue()}
    intro = {o.name for o in introspected_activations()}
    assert {"ReLU", "GELU", "SiLU", "Hardswish"} <= intro and "MultiheadAttention" not in intro
    assert {"Conv2d", "ConvTranspose3d", "Linear", "LayerNorm", "MaxPool2d", "softmax", "sum"} <= names
    stochastic = {o.name for o in catalogue() if o.stochastic}
    assert {"Dropout", "RReLU"} <= stochastic and not stochastic & {o.name for o in usable()}


def test_offline_compositions_run_and_follow_the_requested_mix() -> None:
    rng = random.Random(7)
    # renormalised over 1..5 operators where transformers is not installed
    mix = normalised_mix(PUBLISHED_MIX)
    counts: Counter[str] = Counter()
    for _ in range(400):
        k = str(sample_n_ops(rng, mix))
        if k == "transformers":  # a standalone transformers module
            c = compose_transformers(rng, scale=0.1)
            assert c is not None and c.n_ops == 1 and c.data_source.startswith("transformers")
        else:
            c = compose_offline(rng, int(k), scale=0.1)
            assert c is not None and c.n_ops == int(k) and len(c.ops) == int(k)
        counts[k] += 1
    for k, p in mix.items():  # within 4 percentage points of the target on 400 tasks
        assert abs(counts[str(k)] / 400 - p) < 0.04, (k, counts[str(k)] / 400, p)
    import torch

    for _ in range(15):  # and they run
        c = compose_offline(rng, rng.choice([2, 3, 4, 5]), scale=0.1)
        m = import_task_module(task_from_code(c.code, name="t", source="x"))
        with torch.no_grad():
            assert isinstance(m.Model(*m.get_init_inputs())(*m.get_inputs()), torch.Tensor)


def test_datagen_yield_resume_and_files(tmp_path: Path) -> None:
    out = tmp_path / "ops.jsonl"
    cmd = [sys.executable, "-m", "cuda_agent.cli", "datagen", "--n", "4", "--out", str(out), "--device", "cpu",
           "--scale", "0.1", "--min-ms", "0", "--no-compile-filter", "--workers", "2", "--seed", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "yield" in p.stdout and "rejected per filter" in p.stdout
    again = subprocess.run([*cmd[:5], "7", *cmd[6:], "--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    rejects = [json.loads(x) for x in out.with_name("ops.rejects.jsonl").read_text().splitlines()] \
        if out.with_name("ops.rejects.jsonl").exists() else []
    assert len(rows) >= 7 and len({r["task_id"] for r in rows}) == len(rows)  # no duplicates
    indices = [r["index"] for r in rows + rejects]
    assert len(indices) == len(set(indices))  # every candidate once, across both runs
    print(f"yield: {len(rows)} of {len(indices)} candidates")
    assert len(rows) / len(indices) >= 0.5
    for r in rows:
        assert {"ops", "data_source", "code", "task_id", "n_ops", "eager_ms", "filters"} <= set(r)
        assert r["data_source"] == f"torch#{r['n_ops']}"
    loaded = load_tasks(out)
    assert [t.id for t in loaded] == [r["task_id"] for r in rows] and loaded[0].ops == rows[0]["ops"]
    parquet = out.with_suffix(".parquet")
    assert [t.id for t in load_tasks(parquet)] == [r["task_id"] for r in rows]
    datasets = pytest.importorskip("datasets")
    assert len(datasets.load_dataset("json", data_files=str(out))["train"]) == len(rows)


def test_time_limit_stops_new_candidates_and_keeps_the_files(tmp_path: Path) -> None:
    out = tmp_path / "ops.jsonl"
    cmd = [sys.executable, "-m", "cuda_agent.cli", "datagen", "--n", "50", "--out", str(out), "--device", "cpu",
           "--scale", "0.1", "--min-ms", "0", "--no-compile-filter", "--workers", "2", "--seed", "5",
           "--time-limit", "0.5"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "stopped at the time limit" in p.stdout and "--resume" in p.stdout
    lines = out.read_text().splitlines() + (out.with_name("ops.rejects.jsonl").read_text().splitlines()
                                            if out.with_name("ops.rejects.jsonl").exists() else [])
    assert 1 <= len(lines) <= 4  # the first ones in flight finished; nothing new began
    assert out.with_suffix(".parquet").exists() or not out.read_text().strip()


def test_llm_composer_output_is_parsed_and_checked(tmp_path: Path) -> None:
    replies = iter([f"Here it is:\n```python\n{GOOD}```\n", "I cannot do that."])

    def policy(req):  # type: ignore[no-untyped-def]
        assert "compose" in req["messages"][0]["content"]
        return {"content": next(replies)}

    async def both():  # type: ignore[no-untyped-def]
        client = OpenAIClient(OpenAIConfig(model="scripted", base_url=srv.base_url))
        return await compose_llm(client, random.Random(0), 2), await compose_llm(client, random.Random(1), 2)

    with ScriptedServer(policy) as srv:
        first, second = asyncio.run(both())
    assert first is not None and first.code.strip() == GOOD.strip() and first.data_source == "llm#2"
    assert second is None
    row = run_one(tmp_path, first.code, compile_filter=False, runtime_filter=False)
    assert row["accepted"]


@pytest.mark.parametrize("name, n", [("ops50", 50), ("h200_205", 205)])
def test_committed_sample_loads(name: str, n: int) -> None:
    path = REPO / "examples" / "datagen" / f"{name}.jsonl"
    tasks = load_tasks(path)
    assert len(tasks) == n and len({t.id for t in tasks}) == len(tasks)
    assert all(t.ops for t in tasks) and [t.id for t in load_tasks(path.with_suffix(".parquet"))] == [t.id for t in tasks]
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    # decontaminated against a benchmark named within its folder (no machine path)
    assert all(not r["filters"]["decontaminate"]["closest"].startswith(("/", ".")) for r in rows)
    assert max(r["filters"]["decontaminate"]["max_similarity"] for r in rows) <= 0.9
