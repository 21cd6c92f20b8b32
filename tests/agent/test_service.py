"""The episode's evaluation service: its start-up prefetch (baselines and the first build
done while the agent reads the task) and commands sent while it runs."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

from cuda_agent.agent.service import EvalService
from cuda_agent.evaluator import build as B
from cuda_agent.evaluator import record as R
from cuda_agent.paths import cache_dir
from cuda_agent.tasks import task_from_code
from cuda_agent.workspace import create_workspace

REPO = Path(__file__).resolve().parents[2]
AXPBY = (REPO / "examples" / "tasks" / "axpby.py").read_text()
SOL = REPO / "examples" / "solutions" / "axpby_cpu"


def new_task_workspace(tmp_path: Path, code: str) -> Path:
    # a task no other test has seen: its baselines are not cached yet
    task = task_from_code(code + f"\n# {uuid.uuid4().hex}\n", name="axpby_prefetch", source="test")
    return create_workspace(task, tmp_path / "ws", device="cpu")


def cached_entries(task_id: str) -> list[Path]:
    import json

    return [f for f in cache_dir("baselines").glob("*.json") if json.loads(f.read_text())["key"]["task_id"] == task_id]


def test_prefetch_measures_the_baselines_and_builds_before_the_first_command(tmp_path: Path) -> None:
    ws = new_task_workspace(tmp_path, AXPBY)
    from cuda_agent.workspace import load_record

    task_id = load_record(ws).task.id
    assert cached_entries(task_id) == []
    seen: list[tuple[str, object]] = []
    service = EvalService(ws, tmp_path, listener=lambda name, argv, rc, text, res: seen.append((name, res)))
    service.start()
    try:
        # a command sent while the prefetch runs waits for it, then runs as usual
        box: dict[str, object] = {}
        th = threading.Thread(target=lambda: box.update(out=service.run("compile", [])))
        th.start()
        assert service.wait_prefetched(600)
        pre = service.prefetched
        assert pre is not None and pre["baselines"] == "measured", pre
        assert pre["headers"] == "cached" or pre["headers"].startswith("built: "), pre
        tc = B.toolchain("cpu")
        assert all(B.pch_built(tc, kind) for kind in B.PCH_HEADERS)
        assert seen[0] == ("prefetch", pre)
        assert len(cached_entries(task_id)) == 1  # under the key the profiling below uses
        th.join(120)
        rc, text = box["out"]  # type: ignore[misc]
        assert rc == 0 and "Compile success" in text, text  # the starter sources

        shutil.copy(SOL / "model_new.py", ws / "model_new.py")
        for f in (SOL / "kernels").iterdir():
            shutil.copy(f, ws / "kernels" / f.name)
        rc, text = service.run("profiling", [])
        assert rc == 0, text
        res = seen[-1][1]
        assert isinstance(res, R.EvalResult) and res.status == "ok" and res.speedup_vs_compile
        # the first profiling found the baselines (re-measured only if the CPU's speed moved)
        assert "baseline" not in res.timings_s or R.FLAG_REMEASURED in res.flags, (res.timings_s, res.flags)
    finally:
        service.close()


def test_prefetch_of_a_broken_task_leaves_the_verdict_to_the_evaluation(tmp_path: Path) -> None:
    broken = AXPBY.replace("def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:\n",
                           "def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:\n"
                           "        raise RuntimeError('the task itself is broken')\n")
    assert broken != AXPBY
    ws = new_task_workspace(tmp_path, broken)
    seen: list[tuple[str, object]] = []
    service = EvalService(ws, tmp_path, listener=lambda name, argv, rc, text, res: seen.append((name, res)))
    service.start()
    try:
        assert service.wait_prefetched(600)
        pre = service.prefetched
        assert pre is not None and str(pre["baselines"]).startswith("failed:"), pre
        assert "the task itself is broken" in str(pre["baselines"]), pre
        shutil.copy(SOL / "model_new.py", ws / "model_new.py")
        for f in (SOL / "kernels").iterdir():
            shutil.copy(f, ws / "kernels" / f.name)
        rc, text = service.run("profiling", [])  # the service still serves, and says what is wrong
        assert rc == 1 and "the task itself is broken" in text, text
    finally:
        service.close()


def test_no_prefetch_when_switched_off(tmp_path: Path) -> None:
    ws = new_task_workspace(tmp_path, AXPBY)
    service = EvalService(ws, tmp_path, prefetch=False)
    service.start()
    try:
        assert service.wait_prefetched(0) and service.prefetched is None
    finally:
        service.close()


def test_builds_wait_for_the_prefetch_only_beside_a_cpu_measurement(tmp_path: Path) -> None:
    task = task_from_code(AXPBY, name="axpby", source="test")
    cpu = EvalService(create_workspace(task, tmp_path / "cpu", device="cpu"), tmp_path, prefetch=False)
    gpu = EvalService(create_workspace(task, tmp_path / "gpu", device="cuda"), tmp_path, prefetch=False)
    assert not cpu._builds_beside_prefetch() and gpu._builds_beside_prefetch()
    broken = tmp_path / "broken"
    broken.mkdir()
    assert not EvalService(broken, tmp_path, prefetch=False)._builds_beside_prefetch()
