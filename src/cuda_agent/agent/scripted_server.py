"""A local HTTP server that speaks OpenAI chat completions with scripted replies.

For tests, demos and benchmarks that need a model server but no model: the real
`openai` client talks to it over HTTP exactly as it would to vLLM. A *policy* maps each
request (the JSON body) to the assistant's turn, `{"content": ..., "tool_calls":
[{"name": ..., "arguments": {...} or "raw text"}]}`; `from_turns` plays a fixed list,
choosing the turn by how many assistant messages the request already holds, so many
concurrent conversations can share one server. `fail_first=N` answers the first N
requests with HTTP 503, as an overloaded server would.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Policy = Callable[[dict[str, Any]], dict[str, Any]]


def _tokens(obj: Any) -> int:
    return max(1, len(json.dumps(obj, ensure_ascii=False)) // 4)


def from_turns(turns: Sequence[dict[str, Any]]) -> Policy:
    def policy(req: dict[str, Any]) -> dict[str, Any]:
        k = sum(1 for m in req.get("messages", []) if m.get("role") == "assistant")
        return turns[k] if k < len(turns) else {"content": "Done."}
    return policy


class ScriptedServer:
    def __init__(self, policy: Policy, *, fail_first: int = 0, delay_s: float = 0.0) -> None:
        self.policy = policy
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.failures = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    req = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
                    return
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                with server._lock:
                    server.requests.append(req)
                    fail = server.failures < server.fail_first
                    if fail:
                        server.failures += 1
                if fail:
                    self._send(503, {"error": {"message": "server overloaded, try again", "type": "server_error"}})
                    return
                if server.delay_s:
                    time.sleep(server.delay_s)
                try:
                    turn = server.policy(req)
                except Exception as exc:  # a broken script is the test's bug: say it loudly
                    self._send(500, {"error": {"message": f"policy failed: {type(exc).__name__}: {exc}"}})
                    return
                self._send(200, server.response(req, turn))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def response(self, req: dict[str, Any], turn: dict[str, Any]) -> dict[str, Any]:
        n = next(self._ids)
        calls = []
        for j, tc in enumerate(turn.get("tool_calls") or []):
            args = tc.get("arguments", {})
            calls.append({"id": tc.get("id") or f"call_{n}_{j}", "type": "function",
                          "function": {"name": tc["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
        msg: dict[str, Any] = {"role": "assistant", "content": turn.get("content")}
        if calls:
            msg["tool_calls"] = calls
        prompt, completion = _tokens(req.get("messages", [])), _tokens(turn)
        if "usage" in turn:
            prompt, completion = turn["usage"]
        return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
                "model": req.get("model", "scripted"),
                "choices": [{"index": 0, "message": msg, "finish_reason": turn.get("finish_reason")
                             or ("tool_calls" if calls else "stop")}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
