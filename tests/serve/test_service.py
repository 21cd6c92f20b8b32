"""The evaluation service on the CPU backend: a real HTTP server and client, real worker
processes and the real evaluator (sandboxed)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from evaluator import cases as C

from cuda_agent.serve.client import HTTPClient, LocalClient, QueueFullError, ServiceError
from cuda_agent.serve.engine import (
    DEVICE_LOG,
    Engine,
    FairQueue,
    ServiceConfig,
    Ticket,
    device_overlaps,
)
from cuda_agent.serve.http import Server
from cuda_agent.serve.requests import EvalRequest

TASK = C.AXPBY_TASK.read_text()
GOOD = C.axpby()
# the kernels of GOOD (built once), a model that never finishes importing
HANG = C.axpby(C.AXPBY_MODEL_NEW.replace("import cuda_extension", "import cuda_extension\n\nwhile True:\n    pass"))
BROKEN = C.axpby(**{"axpby__cpp": C.AXPBY_KERNELS["kernels/axpby.cpp"].replace("out[i] = alpha", "out[i] = alpah")})
FAST = {"profile": False, "trials": 1, "distribution_trials": 0}


@contextlib.contextmanager
def service(tmp_path: Path, **cfg: Any) -> Iterator[tuple[Engine, Server, HTTPClient]]:
    opts = {"run_timeout_s": 60.0, **cfg.pop("eval_options", {})}
    engine = Engine(ServiceConfig(device="cpu", eval_options=opts, log_dir=tmp_path / "logs", **cfg)).start()
    server = Server(engine, unix=tmp_path / "eval.sock").start()
    try:
        assert server.url is not None
        yield engine, server, HTTPClient(server.url, name="test")
    finally:
        server.close(grace_s=0)


def in_thread(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["answer"] = fn(*args, **kw)
        except Exception as exc:
            out["error"] = exc

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th, out


def wait_for(cond: Any, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def test_http_and_unix_socket_evaluate_cache_and_report_metrics(tmp_path: Path) -> None:
    with service(tmp_path) as (engine, server, client):
        first = client.evaluate(TASK, "axpby", GOOD, FAST)
        assert first["status"] == "done" and first["result"]["status"] == "ok" and first["result"]["correct"]
        assert first["worker"] == "cpu0" and not first.get("cached")
        # the same request again, over the Unix socket: answered from the cache, not evaluated
        unix = HTTPClient(f"unix://{tmp_path / 'eval.sock'}", name="other")
        again = unix.evaluate(TASK, "axpby", GOOD, FAST)
        assert again["cached"] and again["result"] == first["result"]
        # a compile error is a verdict, answered like any other
        broken = client.evaluate(TASK, "axpby", BROKEN, FAST)
        assert broken["result"]["status"] == "compile_error" and "alpah" in broken["result"]["message"]
        m = client.metrics()
        assert m["counts"]["evaluations"] == 2 and m["cache"]["hits"] == 1 and m["counts"]["done"] == 3
        assert m["latency_s"]["n"] == 3 and m["latency_s"]["p50"] > 0 and m["workers"][0]["busy_fraction"] > 0
        assert m["verdicts"] == {"ok": 2, "compile_error": 1}
        status, text = client.request("GET", "/metrics")
        assert status == 200 and 'cuda_agent_worker_busy_fraction{worker="cpu0"}' in text
        assert 'cuda_agent_requests_total{outcome="done"} 3' in text and "cuda_agent_cache_hits_total 1" in text
        assert "cuda-agent serve" not in engine.progress_line() and "done 3 (cached 1)" in engine.progress_line()
    # the device log: what each worker held, and when (the cached answer held none)
    log = [json.loads(x) for x in (tmp_path / "logs" / DEVICE_LOG).read_text().splitlines()]
    assert [(x["worker"], x["verdict"]) for x in log] == [("cpu0", "ok"), ("cpu0", "compile_error")]
    assert all(x["start"] <= x["end"] for x in log) and device_overlaps(log) == []


def test_device_log_audit_finds_shared_gpus_and_the_service_refuses_them() -> None:
    runs = [{"id": "a", "worker": "gpu0", "gpu": 0, "start": 0.0, "end": 2.0},
            {"id": "b", "worker": "gpu1", "gpu": 1, "start": 1.0, "end": 3.0},  # another GPU: fine
            {"id": "c", "worker": "gpu0", "gpu": 0, "start": 2.0, "end": 4.0}]
    assert device_overlaps(runs) == []
    runs.append({"id": "d", "worker": "gpu0-again", "gpu": 0, "start": 3.5, "end": 5.0})
    assert device_overlaps(runs) == [("c", "d")]
    with pytest.raises(ValueError, match="one worker"):
        Engine(ServiceConfig(device="cuda", gpus=[0, 1, 0]))


def test_builds_run_ahead_and_failures_never_reach_a_worker(tmp_path: Path) -> None:
    with service(tmp_path, build_workers=1) as (engine, _, client):
        seen: list[int] = []
        th, out = in_thread(client.evaluate, TASK, "axpby", GOOD, {**FAST, "seed": 7})
        broken = client.evaluate(TASK, "axpby", BROKEN, {**FAST, "seed": 7})
        th.join()
        seen.append(engine.counts["builds_failed_early"])
        assert broken["result"]["status"] == "compile_error" and broken["worker"] is None
        assert broken["build_s"] is not None and out["answer"]["result"]["status"] == "ok"
        assert out["answer"]["build_s"] is not None and out["answer"]["worker"] == "cpu0"
        assert seen == [1] and engine.slots[0].evaluations == 1
        built = client.evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 8}, mode="build")
        assert built["built"] and "result" not in built


def test_back_pressure_deadlines_and_a_replaced_worker(tmp_path: Path) -> None:
    with service(tmp_path, max_queue=1) as (engine, _, client):
        # a model that never finishes importing holds the only worker until its deadline
        th_hang, hang = in_thread(client.evaluate, TASK, "axpby", HANG, FAST, deadline_s=8)
        wait_for(lambda: engine.slots[0].current is not None)
        # one waits (the queue holds one) and passes its deadline while waiting
        th_wait, waiting = in_thread(client.evaluate, TASK, "axpby", GOOD, {**FAST, "seed": 1}, deadline_s=1.5)
        wait_for(lambda: engine.metrics()["queue"]["waiting"] == 1)
        with pytest.raises(QueueFullError) as full:  # told at once, not left to time out
            client.evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 2})
        assert full.value.status == 429 and full.value.retry_after_s >= 1
        th_wait.join()
        assert waiting["answer"]["status"] == "deadline" and "waiting" in waiting["answer"]["error"]
        assert waiting["answer"]["worker"] is None  # it never ran
        th_hang.join()
        assert hang["answer"]["status"] == "deadline" and "running" in hang["answer"]["error"]
        assert 7 < hang["answer"]["total_s"] < 20
        # the killed worker was replaced: the next request runs
        after = client.evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 3})
        assert after["result"]["status"] == "ok" and engine.slots[0].restarts == 1
        assert engine.counts["queue_full"] == 1 and engine.counts["deadline"] == 2


def test_a_worker_killed_mid_evaluation_is_replaced_and_the_request_run_again(tmp_path: Path) -> None:
    with service(tmp_path) as (engine, _, client):
        th, out = in_thread(client.evaluate, TASK, "axpby", GOOD, {**FAST, "seed": 11})
        wait_for(lambda: engine.slots[0].current is not None)
        time.sleep(1.0)  # inside the evaluation
        pid = client.metrics()["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        th.join()
        ans = out["answer"]
        assert ans["status"] == "done" and ans["result"]["status"] == "ok"
        m = client.metrics()
        assert m["workers"][0]["restarts"] == 1 and m["workers"][0]["pid"] != pid


def test_drain_finishes_or_interrupts_every_accepted_request(tmp_path: Path) -> None:
    engine = Engine(ServiceConfig(device="cpu", eval_options={"run_timeout_s": 60.0})).start()
    server = Server(engine).start()
    assert server.url is not None
    client = HTTPClient(server.url)
    threads = [in_thread(client.evaluate, TASK, "axpby", GOOD, {**FAST, "seed": 20 + k}) for k in range(2)]
    threads.append(in_thread(client.evaluate, TASK, "axpby", HANG, FAST))
    wait_for(lambda: engine.counts["submitted"] == 3)
    closing = threading.Thread(target=server.close, kwargs={"grace_s": 3.0})
    closing.start()
    wait_for(lambda: engine.draining)
    with pytest.raises(ServiceError) as refused:
        client.evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 99})
    assert refused.value.status == 503
    closing.join()
    answers = []
    for th, out in threads:
        th.join(timeout=30)
        answers.append(out["answer"]["status"])
    # every accepted request has an answer: the hanging one (and any not reached) interrupted
    assert len(answers) == 3 and "interrupted" in answers and set(answers) <= {"done", "interrupted"}


def test_refusals_tokens_and_malformed_requests(tmp_path: Path) -> None:
    engine = Engine(ServiceConfig(device="cpu"))  # no workers needed: nothing here is evaluated
    with pytest.raises(ValueError, match="needs a token"):
        Server(engine, host="0.0.0.0")
    server = Server(engine, host="127.0.0.1", token="s3cret").start()
    try:
        assert server.url is not None
        assert HTTPClient(server.url, token="").health()["ok"]  # health needs no token
        for token in ("", "wrong"):
            with pytest.raises(ServiceError) as denied:
                HTTPClient(server.url, token=token).metrics()
            assert denied.value.status == 401
        client = HTTPClient(server.url, token="s3cret")
        assert client.metrics()["queue"]["waiting"] == 0

        def post(body: bytes, length: int | None = None) -> tuple[int, dict[str, Any]]:
            host, port = server.url.rsplit(":", 1)  # type: ignore[union-attr]
            conn = http.client.HTTPConnection(host.removeprefix("http://"), int(port), timeout=30)
            conn.putrequest("POST", "/v1/evaluate")
            conn.putheader("Authorization", "Bearer s3cret")
            conn.putheader("Content-Length", str(len(body) if length is None else length))
            conn.endheaders()
            conn.send(body)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())

        good = EvalRequest(TASK, "axpby", GOOD).to_json()
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (b"[1, 2]", 400, "JSON object"),
            (json.dumps({**good, "options": {"sandbox": False}}).encode(), 400, "not a client's to choose"),
            (json.dumps({**good, "options": {"trials": 10**6}}).encode(), 400, "between"),
            (json.dumps({**good, "solution": {"files": {"../x.py": "x", "model_new.py": ""}}}).encode(), 400,
             "kernels/"),
            (json.dumps({**good, "task": "nope"}).encode(), 400, "task must be"),
            (json.dumps({**good, "mode": "run"}).encode(), 400, "mode must be"),
            (json.dumps({**good, "extra": 1}).encode(), 400, "unknown request field"),
        ]
        for body, code, words in cases:
            status, ans = post(body)
            assert status == code and words in ans["error"], (body[:60], status, ans)
        status, ans = post(b"{}", length=64 << 20)  # refused before its body is read
        assert status == 413
        status, _ = client.request("GET", "/nowhere")
        assert status == 404
        assert engine.counts["submitted"] == 0
    finally:
        server.stop_listening()


def test_fair_queue_takes_turns_between_clients() -> None:
    q = FairQueue()

    def ticket(client: str, k: int) -> Ticket:
        return Ticket(EvalRequest(TASK, f"t{k}", GOOD, client=client), deadline=time.monotonic() + 60)

    for k in range(4):
        q.put(ticket("busy", k))
    q.put(ticket("light", 9))
    got = [(t.req.client, t.req.task_name) for t in iter(lambda: q.get(0.01), None)]
    assert got == [("busy", "t0"), ("light", "t9"), ("busy", "t1"), ("busy", "t2"), ("busy", "t3")]


def test_the_in_process_client_gives_the_services_answers(tmp_path: Path) -> None:
    with service(tmp_path) as (engine, _, client):
        over_http = client.evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 5})
        local = LocalClient(engine).evaluate(TASK, "axpby", GOOD, {**FAST, "seed": 5})
        assert local["cached"] and local["result"] == over_http["result"]


def test_the_serve_command_listens_reports_and_drains_on_sigterm(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    sock = tmp_path / "serve.sock"
    proc = subprocess.Popen([sys.executable, "-m", "cuda_agent.cli", "serve", "--device", "cpu", "--port", "0",
                             "--unix", str(sock), "--quiet"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        url = re.search(r"listening on (http://\S+)", line)
        assert url, line
        client = HTTPClient(url.group(1))
        assert client.health() == {"ok": True, "draining": False}
        assert HTTPClient(f"unix://{sock}").metrics()["workers"][0]["name"] == "cpu0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not sock.exists()  # removed on the way out
