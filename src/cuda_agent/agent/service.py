"""The episode's evaluation service: the workspace commands, run outside the sandbox.

Inside the agent's shell, `bash utils/compile.sh`, `python3 -m utils.verification` and
`python3 -m utils.profiling` send their name and arguments over a Unix socket (see
`cuda_agent.workspace.commands`). This service answers them by running the trusted
evaluator on the episode's workspace, one request at a time, and reports every result
to the loop (for the trajectory, the best state and `--score-every-build`). Nothing the
shell sends chooses the workspace or the evaluator's options; a request is a command
name and its flags.

On `start()` the service first does, in the background, what the episode's first
evaluations would otherwise wait for (`commands.prefetch`): the task's baselines
(torch.compile included) are measured and cached, and the precompiled torch headers
built if this machine has none yet. That overlaps the agent's first turns, which read the
task; a command sent meanwhile waits for it (on CUDA a build does not: it is CPU work,
and the baselines' numbers are device time). Its outcome goes to the listener as the
command "prefetch".
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuda_agent.workspace.commands import COMMANDS, run_command

# (command, argv, exit code, output text, evaluator result or None)
Listener = Callable[[str, list[str], int, str, Any], None]
# runs one workspace command: (name, workspace, argv, emit, sandbox, warm) -> (exit code, result);
# `run_command` here, or one that sends the solution to evaluation workers elsewhere
Runner = Callable[[str, Path, list[str], Callable[[str], None], bool, bool], tuple[int, Any]]


def local_runner(name: str, ws: Path, argv: list[str], emit: Callable[[str], None], sandbox: bool,
                 warm: bool) -> tuple[int, Any]:
    return run_command(name, ws, argv, emit, sandbox=sandbox, warm=warm)

_MAX_REQUEST = 64 * 1024


class EvalService:
    def __init__(self, workspace: Path, control_dir: Path, *, sandbox: bool = True,
                 listener: Listener | None = None, device_lock: Any = None, warm: bool = True,
                 prefetch: bool = True, runner: Runner | None = None) -> None:
        self.workspace = workspace
        self.runner = runner or local_runner
        self.sandbox = sandbox
        # evaluations take spare processes started ahead and leave one (see evaluator.warm)
        self.warm = warm
        self.listener = listener
        self.path = control_dir / "eval.sock"
        self._lock = threading.Lock()  # one evaluation at a time per episode
        # Shared by the episodes on one device: verification and timing take turns there.
        self.device_lock = device_lock if device_lock is not None else contextlib.nullcontext()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.prefetch = prefetch
        self.prefetched: dict[str, Any] | None = None  # what the prefetch did, once done
        self._prefetch_done = threading.Event()

    def start(self) -> None:
        if self.prefetch:
            threading.Thread(target=self._prefetch, daemon=True, name="cuda-agent-prefetch").start()
        else:
            self._prefetch_done.set()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.path))
        self.path.chmod(0o666)  # the sandbox's uid must be able to connect
        s.listen(8)
        s.settimeout(0.2)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, daemon=True, name="cuda-agent-eval-service")
        self._thread.start()

    def _prefetch(self) -> None:
        from cuda_agent.workspace.commands import prefetch

        t0 = time.perf_counter()
        try:
            self.prefetched = prefetch(self.workspace, sandbox=self.sandbox, warm=self.warm,
                                       device_lock=self.device_lock)
        except Exception as exc:  # never fatal: the commands report what is wrong
            self.prefetched = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            self.prefetched = {**(self.prefetched or {}), "seconds": round(time.perf_counter() - t0, 3)}
            self._prefetch_done.set()
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.listener("prefetch", [], 0 if "error" not in self.prefetched else 1,
                              json.dumps(self.prefetched), self.prefetched)

    def _builds_beside_prefetch(self) -> bool:
        """A build may run while the prefetch measures on a GPU (device time, as the bench's
        build pool does), never beside a CPU measurement, which it would slow."""
        from cuda_agent.workspace import load_record

        try:
            return load_record(self.workspace).device == "cuda"
        except Exception:  # an unreadable workspace: the command itself says what is wrong
            return False

    def wait_prefetched(self, timeout_s: float | None = None) -> bool:
        """Wait for the start-up prefetch (benchmarks: as after the agent's first turns)."""
        return self._prefetch_done.wait(timeout_s)

    def close(self) -> None:
        # A prefetch still running is left to finish (its baselines are cached for the next
        # episode of the task; it holds the device lock while it measures, so other
        # episodes' measurements wait for it, and its processes die with this one).
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                data = b""
                while b"\n" not in data and len(data) < _MAX_REQUEST:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data.split(b"\n", 1)[0].decode())
                name, argv = str(req.get("command")), [str(a) for a in req.get("argv") or []]
            except (OSError, ValueError, AttributeError) as exc:
                self._reply(conn, 2, f"[FAIL] malformed request to the evaluation service: {exc}\n")
                return
            rc, text = self.run(name, argv)
            conn.settimeout(None)
            self._reply(conn, rc, text)

    def run(self, name: str, argv: list[str]) -> tuple[int, str]:
        """Run one command on the workspace (also what the loop calls to score a state)."""
        parts: list[str] = []
        result: Any = None
        if not self._prefetch_done.is_set() and not (name == "compile" and self._builds_beside_prefetch()):
            self._prefetch_done.wait()
        with self._lock:
            try:
                if name not in COMMANDS:
                    raise ValueError(f"unknown command {name!r}")
                with self.device_lock if name != "compile" else contextlib.nullcontext():
                    rc, result = self.runner(name, self.workspace, argv, parts.append, self.sandbox, self.warm)
            except (ValueError, SystemExit) as exc:  # usage errors (argparse)
                rc, parts = 2, [*parts, f"{exc}\n"]
            except Exception as exc:  # the evaluator itself failed: say so, keep serving
                rc, parts = 1, [*parts, f"[FAIL] evaluator error: {type(exc).__name__}: {exc}\n",
                                traceback.format_exc(limit=4)[-2000:]]
        text = "".join(parts)
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.listener(name, argv, rc, text, result)
        return rc, text

    @staticmethod
    def _reply(conn: socket.socket, rc: int, text: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"rc": rc, "output": text}).encode())
            conn.shutdown(socket.SHUT_WR)
