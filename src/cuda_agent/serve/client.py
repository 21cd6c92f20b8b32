"""Clients of the evaluation service: over HTTP (a TCP address or a Unix socket) or in
this process (an engine started here when no service is given). Both answer the same
dict as the service: {"status": "done", "result": {...EvalResult...}, ...}.

    client = connect("http://127.0.0.1:8765", token=...)   # or "unix:///run/cuda-agent.sock"
    answer = client.evaluate(task_code, "axpby", files, options={"profile": True})
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.parse
from typing import Any, Protocol

from cuda_agent.serve.requests import EvalRequest

TOKEN_ENV = "CUDA_AGENT_SERVICE_TOKEN"


class ServiceError(RuntimeError):
    """The service refused or failed a request; `status` is its HTTP status."""

    def __init__(self, status: int, message: str, answer: dict[str, Any] | None = None) -> None:
        super().__init__(f"evaluation service: {message} (HTTP {status})")
        self.status = status
        self.answer = answer or {}


class QueueFullError(ServiceError):
    @property
    def retry_after_s(self) -> float:
        return float(self.answer.get("retry_after_s") or 1.0)


class EvalClient(Protocol):
    def evaluate(self, task_code: str, task_name: str, files: dict[str, str], options: dict[str, Any] | None = None,
                 *, mode: str = "evaluate", client: str | None = None, deadline_s: float | None = None,
                 build_key: str | None = None) -> dict[str, Any]: ...


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class HTTPClient:
    """One client; safe to share between threads (a connection per call)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float | None = None,
                 name: str | None = None) -> None:
        self.url = url
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout_s = timeout_s
        self.name = name
        u = urllib.parse.urlparse(url)
        if u.scheme == "unix":
            self._unix: str | None = u.path
            self._host, self._port = "", 0
        elif u.scheme == "http":
            self._unix = None
            self._host, self._port = u.hostname or "127.0.0.1", u.port or 80
        else:
            raise ValueError(f"service address {url!r}: use http://HOST:PORT or unix:///path/to/socket")

    def _conn(self) -> http.client.HTTPConnection:
        if self._unix is not None:
            return _UnixConnection(self._unix, self.timeout_s)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        conn = self._conn()
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, (json.loads(data) if "json" in ctype else data.decode())
        finally:
            conn.close()

    def evaluate(self, task_code: str, task_name: str, files: dict[str, str], options: dict[str, Any] | None = None,
                 *, mode: str = "evaluate", client: str | None = None, deadline_s: float | None = None,
                 build_key: str | None = None, retry_full_s: float = 0.0) -> dict[str, Any]:
        """Evaluate; waits for the answer. A full queue raises QueueFullError, unless
        `retry_full_s` > 0: then it retries (as the service's Retry-After says) for that long."""
        req = EvalRequest(task_code, task_name, files, options=dict(options or {}), mode=mode,
                          client=client or self.name or "anonymous", deadline_s=deadline_s, build_key=build_key)
        give_up = time.monotonic() + retry_full_s
        while True:
            status, ans = self.request("POST", "/v1/evaluate", req.to_json())
            if status == 429 and time.monotonic() < give_up:
                time.sleep(min(float(ans.get("retry_after_s") or 1.0), max(0.1, give_up - time.monotonic())))
                continue
            return _checked(status, ans)

    def metrics(self) -> dict[str, Any]:
        return _checked(*self.request("GET", "/v1/metrics"))

    def health(self) -> dict[str, Any]:
        return _checked(*self.request("GET", "/healthz"))


def _checked(status: int, ans: Any) -> dict[str, Any]:
    if not isinstance(ans, dict):
        raise ServiceError(status, str(ans)[:300])
    if status == 429:
        raise QueueFullError(status, str(ans.get("error")), ans)
    if status >= 400 and status not in (500, 503, 504) or (status >= 500 and "status" not in ans):
        raise ServiceError(status, str(ans.get("error")), ans)
    return ans  # done, or a deadline / interruption / evaluator error the answer describes


class LocalClient:
    """The same calls on an engine in this process."""

    def __init__(self, engine: Any, name: str | None = None) -> None:
        self.engine = engine
        self.name = name

    def evaluate(self, task_code: str, task_name: str, files: dict[str, str], options: dict[str, Any] | None = None,
                 *, mode: str = "evaluate", client: str | None = None, deadline_s: float | None = None,
                 build_key: str | None = None) -> dict[str, Any]:
        req = EvalRequest.parse(EvalRequest(task_code, task_name, files, options=dict(options or {}), mode=mode,
                                            client=client or self.name or "local", deadline_s=deadline_s,
                                            build_key=build_key).to_json())
        return dict(self.engine.evaluate(req))

    def metrics(self) -> dict[str, Any]:
        return dict(self.engine.metrics())


def connect(url: str, token: str | None = None, name: str | None = None) -> HTTPClient:
    return HTTPClient(url, token=token, name=name)
