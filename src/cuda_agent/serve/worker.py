"""An evaluation worker: a process of its own that owns one device slot (one GPU, or a
share of the CPU's cores) and evaluates one job after another there.

Why a process and not a thread of the service: whatever goes wrong in an evaluation the
evaluator does not catch (a crash in torch's own code in this process, a hang, memory
that is never given back) takes one worker down, not the service; the service kills a
worker whose job ran past its deadline and starts another. Each worker keeps its own
spare processes (see `evaluator.warm`) on its own device, so its next evaluation does not
wait for torch's imports, a CUDA context or the profiler's start-up.

    python -m cuda_agent.serve.worker  (jobs as JSON lines on stdin, answers on stdout)

A job: {"id", "mode": "evaluate"|"build"|"prefetch", "task_code", "task_name", "files", "options"}
(`options`: EvalOptions fields, the service's and the client's, already merged). The
answer: {"id", "result": EvalResult} for an evaluation or a build that failed, {"id",
"built": true} for a build, {"id", "baselines": "measured"|"cached"|...} for a prefetch, or
{"id", "error": "..."} where the evaluator itself failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any


class WorkerDied(RuntimeError):
    """The worker process ended (or was killed) before it answered."""


def options_from(d: dict[str, Any]) -> Any:
    from cuda_agent.evaluator import timing
    from cuda_agent.evaluator.options import EvalOptions

    d = dict(d)
    if isinstance(d.get("protocol"), dict):
        d["protocol"] = timing.Protocol(**d["protocol"])
    return EvalOptions(**d)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job, in this process; never raises."""
    from cuda_agent.evaluator.evaluate import evaluate, prebuild, prefetch_baselines
    from cuda_agent.evaluator.solution import SolutionError, solution_from_files
    from cuda_agent.tasks import TaskError, task_from_code

    try:
        task = task_from_code(job["task_code"], name=job["task_name"], source="(request)")
        solution = solution_from_files(job["files"], origin=f"(request {job.get('build_key') or ''})")
        opts = options_from(job["options"])
        if job.get("mode") == "prefetch":
            return {"baselines": prefetch_baselines(task, opts)}
        if job.get("mode") == "build":
            failed = prebuild(task, solution, opts)
            return {"built": True} if failed is None else {"result": failed.to_dict()}
        return {"result": evaluate(task, solution, opts).to_dict()}
    except (TaskError, SolutionError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "bad_input": True}
    except Exception as exc:  # the evaluator itself failed: the service says so and goes on
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)[-3000:]}


def main() -> int:
    # Answers go to the real stdout; anything printed on the way (the evaluator's own
    # diagnostics, a library's warnings) goes to stderr instead of into the protocol.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    answers.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except ValueError:
            answers.write(json.dumps({"error": "malformed job"}) + "\n")
            continue
        t0 = time.perf_counter()
        out = run_job(job)
        out.update(id=job.get("id"), seconds=round(time.perf_counter() - t0, 3))
        answers.write(json.dumps(out) + "\n")
    return 0


class WorkerProcess:
    """The service's handle on one worker process: one job at a time; `kill()` from any
    thread ends the job in flight (its `run` raises WorkerDied)."""

    def __init__(self, name: str, *, env: dict[str, str] | None = None, log: Path | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.name = name
        self.env = env
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.jobs = 0
        self.killed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        stderr: IO[Any] | int = subprocess.DEVNULL
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log, "a")  # noqa: SIM115 (the child holds it; closed below)
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "cuda_agent.serve.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                         start_new_session=True)
        finally:
            if not isinstance(stderr, int):
                stderr.close()
        self.killed = False
        hello = self._read(time.monotonic() + self.start_timeout_s)
        if not hello.get("ready"):
            raise WorkerDied(f"worker {self.name} did not start: {hello}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, job: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """Send one job and wait for its answer (until `deadline`, time.monotonic())."""
        with self._lock:
            if not self.alive():
                raise WorkerDied(f"worker {self.name} is not running")
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(job) + "\n")
                self.proc.stdin.flush()
            except OSError as exc:
                raise WorkerDied(f"worker {self.name}: {exc}") from None
            self.jobs += 1
            return self._read(deadline)

    def _read(self, deadline: float | None) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready, _, _ = select.select([out], [], [], wait)
            if ready:
                line = out.readline()
                if not line:
                    code = self.proc.wait()
                    raise WorkerDied(f"worker {self.name} {'was killed' if self.killed else 'exited'} "
                                     f"(exit code {code})")
                with contextlib.suppress(ValueError):
                    return dict(json.loads(line))
                continue  # not ours: ignore
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                raise WorkerDied(f"worker {self.name} passed the deadline and was killed")

    def kill(self) -> None:
        """End the worker and every process it started (its own session)."""
        self.killed = True
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 9)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)

    def close(self) -> None:
        """Ask the worker to finish (stdin closed), then make sure it has."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
