"""The evaluation service on a real GPU: worker processes per GPU, the build stage with
nvcc, verdicts and speedups as the evaluator gives them, the cache, a killed worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from cuda_agent.serve.client import HTTPClient
from cuda_agent.serve.engine import Engine, ServiceConfig
from cuda_agent.serve.http import Server

from . import cases_cuda as C

pytestmark = pytest.mark.gpu

TASK = C.AXPBY_TASK.read_text()
BROKEN = {**C.AXPBY, "kernels/axpby.cu": C.AXPBY["kernels/axpby.cu"].replace("alpha * x.x", "alpha * x.q")}


def test_the_service_on_the_gpu(tmp_path: Path) -> None:
    engine = Engine(ServiceConfig(device="cuda", gpus=[0], build_workers=2, log_dir=tmp_path / "logs")).start()
    server = Server(engine).start()
    try:
        assert server.url is not None
        client = HTTPClient(server.url, name="gpu-test")
        t0 = time.perf_counter()
        first = client.evaluate(TASK, "axpby", C.AXPBY, {"seed": 1})
        cold = time.perf_counter() - t0
        res = first["result"]
        assert first["status"] == "done" and res["status"] == "ok" and res["correct"], res["message"]
        assert first["worker"] == "gpu0" and res["speedup_vs_compile"] and res["reward"] >= 1
        broken = client.evaluate(TASK, "axpby", BROKEN, {"seed": 1})
        assert broken["result"]["status"] == "compile_error" and broken["worker"] is None  # the build stage's
        again = client.evaluate(TASK, "axpby", C.AXPBY, {"seed": 1})
        assert again["cached"] and again["result"] == res
        # a warm evaluation (spares ready, build cached) is far quicker than the first
        t0 = time.perf_counter()
        warm = client.evaluate(TASK, "axpby", C.AXPBY, {"seed": 2})
        warm_s = time.perf_counter() - t0
        assert warm["result"]["status"] == "ok" and warm_s < cold, (warm_s, cold)
        # the worker killed mid-evaluation: replaced, the request run again
        out: dict[str, object] = {}
        th = threading.Thread(target=lambda: out.update(a=client.evaluate(TASK, "axpby", C.AXPBY, {"seed": 3})))
        th.start()
        while engine.slots[0].current is None:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(client.metrics()["workers"][0]["pid"], signal.SIGKILL)
        th.join()
        assert out["a"]["result"]["status"] == "ok"  # type: ignore[index]
        m = client.metrics()
        print(f"\ncold {cold:.1f} s, warm {warm_s:.1f} s; metrics {m}")
        assert m["workers"][0]["restarts"] == 1 and m["counts"]["builds_failed_early"] == 1
    finally:
        server.close(grace_s=0)
