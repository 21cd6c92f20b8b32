"""The evaluation service over HTTP/JSON, on a TCP port and/or a Unix socket.

    POST /v1/evaluate   a request (see `requests`); answered when evaluated:
                        200 {"status": "done", "result": {...EvalResult...}, "cached": ...}
                        400 malformed, 401 no or wrong token, 413 too large,
                        429 queue full (Retry-After), 503 shutting down,
                        504 deadline passed, 500 the evaluator failed
    GET  /metrics       Prometheus text: queue depth, evaluations per hour, busy fraction
                        per worker, latency percentiles, cache hits
    GET  /v1/metrics    the same as JSON
    GET  /healthz       {"ok": true, "draining": false}

Bound to anything but a loopback address, the service needs a token (`Authorization:
Bearer TOKEN`, checked on every request, /healthz aside): it evaluates untrusted code, so
it must never be an open door. A Unix socket is made readable by its owner only.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import os
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cuda_agent.serve.engine import (
    BAD_INPUT,
    DEADLINE,
    DONE,
    ERROR,
    INTERRUPTED,
    Draining,
    Engine,
    QueueFull,
)
from cuda_agent.serve.requests import MAX_BODY_BYTES, EvalRequest, RequestError

_STATUS = {DONE: 200, DEADLINE: 504, INTERRUPTED: 503, ERROR: 500, BAD_INPUT: 400}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Handler(BaseHTTPRequestHandler):
    server_version = "cuda-agent-serve/1"
    protocol_version = "HTTP/1.1"
    engine: Engine
    token: str | None
    active: _Count  # requests being answered (see Server.close)
    timeout = 300  # an idle kept-alive connection is dropped after this

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # the engine's metrics and progress line say what happens

    def address_string(self) -> str:
        return str(self.client_address[0]) if isinstance(self.client_address, tuple) else "unix"

    def _send(self, code: int, body: dict[str, Any] | str, headers: dict[str, str] | None = None) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data)

    def _authorized(self) -> bool:
        if not self.token:
            return True
        got = self.headers.get("Authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), self.token.encode()):
            return True
        self._send(401, {"error": "this service needs its token: Authorization: Bearer TOKEN"},
                   {"WWW-Authenticate": "Bearer"})
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, {"ok": True, "draining": self.engine.draining})
            return
        if not self._authorized():
            return
        if path == "/v1/metrics":
            self._send(200, self.engine.metrics())
        elif path == "/metrics":
            self._send(200, prometheus(self.engine.metrics()))
        else:
            self._send(404, {"error": f"no such endpoint: GET {path}"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path != "/v1/evaluate":
            self._send(404, {"error": f"no such endpoint: POST {path}"})
            return
        self.active.add(1)
        try:
            self._evaluate()
        finally:
            self.active.add(-1)

    def _evaluate(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, {"error": "a request needs its Content-Length"})
            return
        if length > MAX_BODY_BYTES or length < 0:
            self.close_connection = True  # its body is not read
            self._send(413, {"error": f"the request is larger than {MAX_BODY_BYTES} bytes"})
            return
        try:
            req = EvalRequest.from_body(self.rfile.read(length))
        except RequestError as exc:
            self._send(exc.status, {"error": str(exc)})
            return
        try:
            ticket = self.engine.submit(req)
        except QueueFull as exc:
            self._send(429, {"error": str(exc), "retry_after_s": exc.retry_after_s},
                       {"Retry-After": str(max(1, round(exc.retry_after_s)))})
            return
        except Draining as exc:
            self._send(503, {"error": str(exc)})
            return
        ans = ticket.wait()
        assert ans is not None
        self._send(_STATUS.get(ans["status"], 500), ans)


def prometheus(m: dict[str, Any]) -> str:
    """The metrics in Prometheus' text format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP cuda_agent_{name} {help_}")
        lines.append(f"# TYPE cuda_agent_{name} {kind}")
        for labels, v in samples:
            if v is not None:
                lines.append(f"cuda_agent_{name}{labels} {v}")

    q = m["queue"]
    metric("queue_waiting", "gauge", "requests accepted and not yet running", [("", q["waiting"])])
    metric("queue_running", "gauge", "requests running on a worker", [("", q["running"])])
    metric("evaluations_per_hour", "gauge", "evaluations per hour since the start", [("", m["evaluations_per_hour"])])
    metric("evaluations_per_hour_recent", "gauge", "evaluations per hour over the last 10 minutes",
           [("", m["evaluations_per_hour_recent"])])
    metric("worker_busy_fraction", "gauge", "share of the uptime each worker spent evaluating",
           [(f'{{worker="{w["name"]}"}}', w["busy_fraction"]) for w in m["workers"]])
    metric("worker_restarts_total", "counter", "worker processes started again",
           [(f'{{worker="{w["name"]}"}}', w["restarts"]) for w in m["workers"]])
    metric("latency_seconds", "summary", "request latency, submission to answer",
           [(f'{{quantile="{p / 100}"}}', m["latency_s"][f"p{p}"]) for p in (50, 95, 99)])
    metric("requests_total", "counter", "requests by outcome",
           [(f'{{outcome="{k}"}}', v) for k, v in sorted(m["counts"].items())])
    metric("cache_hits_total", "counter", "requests answered from the result cache", [("", m["cache"]["hits"])])
    return "\n".join(lines) + "\n"


class _Count:
    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self, k: int) -> None:
        with self._lock:
            self.n += k


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


class Server:
    """The HTTP front of one engine: a TCP listener and/or a Unix socket."""

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int | None = 0,
                 unix: Path | None = None, token: str | None = None) -> None:
        if port is not None and not is_loopback(host) and not token:
            raise ValueError(f"binding to {host} (not a loopback address) needs a token (--token or "
                             "CUDA_AGENT_SERVICE_TOKEN): the service runs code it is sent")
        self.active = _Count()
        handler = type("BoundHandler", (Handler,), {"engine": engine, "token": token, "active": self.active})
        self.engine = engine
        self.servers: list[socketserver.BaseServer] = []
        self.url: str | None = None
        self.unix = unix
        if port is not None:
            tcp = ThreadingHTTPServer((host, port), handler)
            tcp.daemon_threads = True
            self.servers.append(tcp)
            shown = f"[{host}]" if ":" in host else host
            self.url = f"http://{shown}:{tcp.server_address[1]}"
        if unix is not None:
            with contextlib.suppress(FileNotFoundError):
                unix.unlink()
            old = os.umask(0o077)
            try:
                self.servers.append(_UnixHTTPServer(str(unix), handler))
            finally:
                os.umask(old)
        self._threads: list[threading.Thread] = []

    def start(self) -> Server:
        for s in self.servers:
            t = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                                 name="cuda-agent-serve-http")
            t.start()
            self._threads.append(t)
        return self

    def stop_listening(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()
        if self.unix is not None:
            with contextlib.suppress(FileNotFoundError):
                self.unix.unlink()

    def close(self, grace_s: float | None = None) -> None:
        """Drain the engine (new requests get 503 meanwhile), let every answer reach its
        client, then stop listening."""
        self.engine.close(grace_s)
        end = time.monotonic() + 10
        while self.active.n > 0 and time.monotonic() < end:
            time.sleep(0.05)
        self.stop_listening()
