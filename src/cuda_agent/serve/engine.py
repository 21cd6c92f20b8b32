"""The evaluation service's engine: requests in, records out, every device kept busy.

    submit ──> result cache ──> build queue ──> build threads (CPU)  ──> device queue ──> workers
              (hit: answered)   (fair, per client)  static checks, build    (fair)     one per GPU
                                                    (a failure is answered              (or CPU slot),
                                                     here, never reaches a GPU)         a process each

- **Back-pressure.** At most `max_queue` requests wait (built or not); one more is refused
  at once with `QueueFull` (HTTP 429), never left to time out.
- **Fairness.** Both queues are served round-robin across clients: a client that sends a
  thousand requests does not starve one that sends one.
- **Deadlines.** A request still waiting at its deadline is answered "deadline" without
  running; one running past it has its worker killed (and replaced), then is answered so.
- **The device is exclusive while it measures.** A worker evaluates one request at a time
  on its GPU, and nothing else of the service touches that GPU: builds are CPU work, done
  ahead by the build threads (into the evaluator's content-hash cache, so the worker's
  build is a cache hit); a worker's next spare processes start (imports on the host) while
  it measures and touch the device only once the measurement is over (`evaluator.warm`).
  On the CPU backend the builds would share the cores being timed, so there they run in
  the worker, in turn with its measurements (`build_workers=0`).
- **Results are cached** by task, solution content, options and mode; a request identical
  to one in flight waits for that one's answer instead of running again.
- **Workers are replaced**: one that dies (or is killed for a deadline) is started again
  before its next job; a job whose worker died for no deadline is run once more.
- **Drain.** `close()` refuses new requests (`Draining`, HTTP 503), lets the queued and
  running ones finish for `grace_s`, then answers what is left "interrupted": no request
  is ever left without an answer.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.serve.requests import EvalRequest
from cuda_agent.serve.worker import WorkerDied, WorkerProcess

DEVICE_LOG = "device.jsonl"


def device_overlaps(lines: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of requests (ids) whose time on a device overlapped, from device.jsonl's lines:
    none, when every measurement had its GPU (or CPU worker) to itself."""
    by_device: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        key = f"gpu{ln['gpu']}" if ln.get("gpu") is not None else str(ln["worker"])
        by_device.setdefault(key, []).append(ln)
    out = []
    for runs in by_device.values():
        runs.sort(key=lambda r: r["start"])
        for a, b in zip(runs, runs[1:], strict=False):
            if b["start"] < a["end"]:
                out.append((a["id"], b["id"]))
    return out

DONE, DEADLINE, INTERRUPTED, ERROR, BAD_INPUT = "done", "deadline", "interrupted", "error", "bad-input"


class QueueFull(RuntimeError):
    def __init__(self, depth: int, retry_after_s: float) -> None:
        super().__init__(f"the evaluation queue is full ({depth} waiting); retry in about {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class Draining(RuntimeError):
    def __init__(self) -> None:
        super().__init__("the evaluation service is shutting down and takes no new requests")


@dataclass
class ServiceConfig:
    device: str = "cpu"  # "cuda" | "cpu"
    gpus: list[int] = field(default_factory=lambda: [0])  # CUDA: one worker per GPU index
    workers: int = 1  # CPU backend: workers sharing the cores
    # builds ahead of the workers (CPU threads); None: half the cores on CUDA, 0 on the CPU
    # backend (where builds run in the worker, never beside a CPU measurement)
    build_workers: int | None = None
    max_queue: int = 256
    default_deadline_s: float = 3600.0
    cache_size: int = 4096  # results kept (LRU)
    sandbox: bool = True
    eval_options: dict[str, Any] = field(default_factory=dict)  # the service's EvalOptions fields
    log_dir: Path | None = None  # workers' stderr, and device.jsonl: which worker (GPU) ran what, and when
    grace_s: float = 600.0  # drain: how long queued and running requests may still take


class Ticket:
    """One accepted request and, once `done`, its answer."""

    _ids = itertools.count(1)

    def __init__(self, req: EvalRequest, deadline: float) -> None:
        self.id = f"r{next(self._ids)}"
        self.req = req
        self.key = req.key()
        self.submitted = time.monotonic()
        self.deadline = deadline
        self.started: float | None = None
        self.finished: float | None = None
        self.worker: str | None = None
        self.answer: dict[str, Any] | None = None
        self.attempts = 0
        self.build_s: float | None = None  # the build stage's seconds, where it ran
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        self._done.wait(timeout_s)
        return self.answer

    def finish(self, status: str, **fields: Any) -> bool:
        """Answer this ticket (once: a later answer is ignored). True if this one was it."""
        if self._done.is_set():
            return False
        self.finished = time.monotonic()
        self.answer = {"id": self.id, "status": status, "queued_s": round((self.started or self.finished) - self.submitted, 3),
                       "total_s": round(self.finished - self.submitted, 3), "worker": self.worker, **fields}
        self._done.set()
        return True


class FairQueue:
    """Items per client, handed out round-robin across clients; `get` blocks."""

    def __init__(self) -> None:
        self._items: dict[str, deque[Ticket]] = {}
        self._order: deque[str] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, t: Ticket) -> None:
        with self._cv:
            q = self._items.get(t.req.client)
            if q is None:
                q = self._items[t.req.client] = deque()
                self._order.append(t.req.client)
            q.append(t)
            self._cv.notify()

    def get(self, timeout_s: float = 0.5) -> Ticket | None:
        with self._cv:
            if not self._order and not self._closed:
                self._cv.wait(timeout_s)
            if not self._order:
                return None
            client = self._order.popleft()
            q = self._items[client]
            t = q.popleft()
            if q:
                self._order.append(client)  # its next one waits for every other client's turn
            else:
                del self._items[client]
            return t

    def remove_if(self, pred: Callable[[Ticket], bool]) -> list[Ticket]:
        with self._cv:
            out: list[Ticket] = []
            for client in list(self._order):
                q = self._items[client]
                keep = deque(t for t in q if not pred(t))
                out += [t for t in q if pred(t)]
                if keep:
                    self._items[client] = keep
                else:
                    del self._items[client]
                    self._order.remove(client)
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._items.values())


@dataclass
class Slot:
    """One device slot and its worker process."""

    name: str
    gpu: int | None
    threads: int | None
    proc: WorkerProcess | None = None
    current: Ticket | None = None
    busy_s: float = 0.0
    busy_since: float | None = None
    evaluations: int = 0
    restarts: int = 0
    start_error: str | None = None
    running: WorkerProcess | None = None  # the process running `current`, while it runs


class Engine:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.started_at = time.monotonic()
        self._lock = threading.RLock()
        self._build_q = FairQueue()
        self._device_q = FairQueue()
        self._waiting = 0  # accepted, not yet on a worker
        self._inflight: dict[str, Ticket] = {}  # key -> the ticket evaluating it
        self._followers: dict[str, list[Ticket]] = {}  # identical requests waiting for that one
        self._results: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._stop = threading.Event()
        self._draining = False
        self._threads: list[threading.Thread] = []
        self.slots = self._make_slots()
        n_build = cfg.build_workers
        if n_build is None:
            n_build = max(1, (os.cpu_count() or 2) // 2) if cfg.device == "cuda" else 0
        self.build_workers = n_build
        self.counts: dict[str, int] = {"submitted": 0, "cache_hits": 0, "joined_in_flight": 0, "queue_full": 0,
                                       "evaluations": 0, "builds_failed_early": 0, "worker_restarts": 0,
                                       DONE: 0, DEADLINE: 0, INTERRUPTED: 0, ERROR: 0, BAD_INPUT: 0}
        self.latencies: deque[tuple[float, float]] = deque(maxlen=20000)  # (finished, seconds)
        self.finished_at: deque[float] = deque(maxlen=100000)  # evaluations' ends, for the rate
        self.verdicts: dict[str, int] = {}

    # -- set-up -------------------------------------------------------------------------

    def _make_slots(self) -> list[Slot]:
        from cuda_agent.machine import usable_cores

        if self.cfg.device == "cuda":
            if len(set(self.cfg.gpus)) != len(self.cfg.gpus):
                raise ValueError(f"GPUs {self.cfg.gpus}: each GPU gets one worker (two would time beside each other)")
            return [Slot(f"gpu{g}", g, None) for g in self.cfg.gpus]
        n = max(1, self.cfg.workers)
        per = max(1, usable_cores() // n)
        return [Slot(f"cpu{i}", None, per) for i in range(n)]

    def start(self) -> Engine:
        for slot in self.slots:
            self._start_worker(slot)
        for slot in self.slots:
            self._spawn(self._work, slot, name=f"cuda-agent-serve-{slot.name}")
        for k in range(self.build_workers):
            self._spawn(self._build_loop, name=f"cuda-agent-serve-build-{k}")
        self._spawn(self._reap, name="cuda-agent-serve-deadlines")
        return self

    def _spawn(self, fn: Callable[..., None], *args: Any, name: str) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=name)
        t.start()
        self._threads.append(t)

    def _start_worker(self, slot: Slot) -> None:
        env = {"CUDA_AGENT_SERVE_WORKER": slot.name}
        log = self.cfg.log_dir / f"worker-{slot.name}.log" if self.cfg.log_dir else None
        slot.proc = WorkerProcess(slot.name, env=env, log=log)
        slot.proc.start()

    def options_for(self, req: EvalRequest, slot: Slot | None) -> dict[str, Any]:
        """The EvalOptions fields of `req` on `slot`: the service's, then the client's."""
        opts: dict[str, Any] = {"device": self.cfg.device, "sandbox": self.cfg.sandbox, "warm": True,
                                **self.cfg.eval_options, **req.options}
        opts["build_key"] = f"serve/{req.build_key or req.key()[:24]}"
        if slot is not None and slot.gpu is not None:
            opts["gpu_index"] = slot.gpu
        if slot is not None and slot.threads is not None and opts.get("threads") is None:
            opts["threads"] = slot.threads
        return opts

    # -- requests -----------------------------------------------------------------------

    def submit(self, req: EvalRequest) -> Ticket:
        """Accept `req` (or raise QueueFull / Draining); its ticket is answered later."""
        deadline_s = min(req.deadline_s or self.cfg.default_deadline_s, self.cfg.default_deadline_s * 24)
        t = Ticket(req, time.monotonic() + deadline_s)
        with self._lock:
            if self._draining:
                raise Draining()
            self.counts["submitted"] += 1
            hit = self._results.get(t.key)
            if hit is not None:
                self._results.move_to_end(t.key)
                self.counts["cache_hits"] += 1
                self.counts[DONE] += 1
                t.finish(DONE, **hit, cached=True)
                self._latency(t)
                return t
            first = self._inflight.get(t.key)
            if first is not None:
                self.counts["joined_in_flight"] += 1
                self._followers.setdefault(t.key, []).append(t)
                return t
            if self._waiting >= self.cfg.max_queue:
                self.counts["queue_full"] += 1
                raise QueueFull(self._waiting, self._retry_after())
            self._waiting += 1
            self._inflight[t.key] = t
        (self._build_q if self.build_workers and req.mode != "prefetch" else self._device_q).put(t)
        return t

    def evaluate(self, req: EvalRequest, timeout_s: float | None = None) -> dict[str, Any]:
        """Submit and wait for the answer (the in-process client)."""
        t = self.submit(req)
        ans = t.wait(timeout_s)
        if ans is None:
            raise TimeoutError(f"no answer within {timeout_s} s")
        return ans

    def _retry_after(self) -> float:
        rate = self._rate_per_s(300.0)
        return min(300.0, max(1.0, self._waiting / rate)) if rate > 0 else 10.0

    def _answer(self, t: Ticket, status: str, **fields: Any) -> None:
        """Answer `t` and every identical request that waited for it; cache a result."""
        with self._lock:
            if t.started is None:
                self._waiting -= 1
            if self._inflight.get(t.key) is t:
                del self._inflight[t.key]
            followers = self._followers.pop(t.key, [])
            if status == DONE:
                self._results[t.key] = {k: v for k, v in fields.items() if k != "cached"}
                while len(self._results) > self.cfg.cache_size:
                    self._results.popitem(last=False)
            self.counts[status] = self.counts.get(status, 0) + 1 + len(followers)
        if t.finish(status, **fields):
            self._latency(t)
        for f in followers:
            f.started = f.started or t.started
            f.worker = t.worker
            if f.finish(status, **fields, joined=t.id):
                self._latency(f)

    def _latency(self, t: Ticket) -> None:
        if t.finished is not None:
            self.latencies.append((t.finished, t.finished - t.submitted))
        res = (t.answer or {}).get("result") or {}
        if res.get("status"):
            with self._lock:
                self.verdicts[res["status"]] = self.verdicts.get(res["status"], 0) + 1

    # -- the build stage ----------------------------------------------------------------

    def _build_loop(self) -> None:
        while not self._stop.is_set():
            t = self._build_q.get()
            if t is None:
                continue
            if t.done:
                continue
            try:
                out = self._build(t)
            except Exception as exc:  # the build stage failed, not the solution: the worker builds
                out = {"error": f"{type(exc).__name__}: {exc}"}
            if "result" in out:  # it failed to build (or was rejected): no GPU needed
                with self._lock:
                    self.counts["builds_failed_early"] += 1
                self._answer(t, DONE, result=out["result"], build_s=out.get("seconds"))
            elif t.req.mode == "build" and out.get("built"):
                self._answer(t, DONE, built=True, build_s=out.get("seconds"))
            elif out.get("bad_input"):
                self._answer(t, BAD_INPUT, error=out["error"])
            else:
                t.build_s = out.get("seconds")
                self._device_q.put(t)

    def _build(self, t: Ticket) -> dict[str, Any]:
        from cuda_agent.serve.worker import run_job

        t0 = time.perf_counter()
        job = self._job(t, None, mode="build")
        out = run_job(job)
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out

    def _job(self, t: Ticket, slot: Slot | None, mode: str | None = None) -> dict[str, Any]:
        return {"id": t.id, "mode": mode or t.req.mode, "task_code": t.req.task_code, "task_name": t.req.task_name,
                "files": t.req.files, "options": self.options_for(t.req, slot), "build_key": t.req.build_key}

    # -- the device stage ---------------------------------------------------------------

    def _work(self, slot: Slot) -> None:
        while not self._stop.is_set():
            t = self._device_q.get()
            if t is None or t.done:
                continue
            with self._lock:
                if t.started is None:
                    self._waiting -= 1
                t.started = time.monotonic()
                slot.current, slot.busy_since = t, t.started
            t.worker = slot.name
            began = time.time()
            try:
                self._run_on(slot, t)
            finally:
                with self._lock:
                    slot.busy_s += time.monotonic() - (slot.busy_since or time.monotonic())
                    slot.current, slot.busy_since = None, None
                self._log_device(slot, t, began)

    def _log_device(self, slot: Slot, t: Ticket, began: float) -> None:
        """One line of device.jsonl: the worker (and GPU) that held this request, from when
        to when (wall clock), and what it ended as. A worker holds one request at a time and
        each GPU has one worker, so no two measurements share a GPU: `device_overlaps` checks it."""
        if self.cfg.log_dir is None:
            return
        answer = t.answer or {}
        line = {"id": t.id, "worker": slot.name, "gpu": slot.gpu, "start": round(began, 4), "end": round(time.time(), 4),
                "task": t.req.task_name, "mode": t.req.mode, "status": answer.get("status"),
                "verdict": (answer.get("result") or {}).get("status"), "attempts": t.attempts}
        with contextlib.suppress(OSError), self._lock:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.cfg.log_dir / DEVICE_LOG, "a") as fh:
                fh.write(json.dumps(line) + "\n")

    def _run_on(self, slot: Slot, t: Ticket) -> None:
        while True:
            t.attempts += 1
            if slot.proc is None or not slot.proc.alive():
                self._restart(slot)
            if slot.proc is None:
                self._answer(t, ERROR, error=f"no evaluation worker could be started on {slot.name}: {slot.start_error}")
                return
            slot.running = slot.proc  # what the deadline reaper may kill (never a replacement)
            try:
                out = slot.proc.run(self._job(t, slot), deadline=t.deadline)
            except WorkerDied as exc:
                slot.running = None
                if time.monotonic() >= t.deadline:
                    self._answer(t, DEADLINE, error=f"passed its deadline while running ({exc})")
                    self._restart(slot)
                    return
                if self._stop.is_set():
                    self._answer(t, INTERRUPTED, error=f"the service stopped during this evaluation ({exc})")
                    return
                self._restart(slot)
                if t.attempts < 2:
                    continue  # not the deadline, not a shutdown: once more on a fresh worker
                self._answer(t, ERROR, error=f"the evaluation worker died twice on this request ({exc})")
                return
            except Exception as exc:
                slot.running = None
                self._answer(t, ERROR, error=f"{type(exc).__name__}: {exc}")
                return
            slot.running = None
            if "result" in out or out.get("built") or "baselines" in out:
                slot.evaluations += 1
                with self._lock:
                    self.counts["evaluations"] += 1
                    self.finished_at.append(time.monotonic())
                fields = {k: out[k] for k in ("result", "built", "baselines") if k in out}
                self._answer(t, DONE, **fields, build_s=t.build_s, eval_s=out.get("seconds"))
            elif out.get("bad_input"):
                self._answer(t, BAD_INPUT, error=out.get("error"))
            else:
                self._answer(t, ERROR, error=out.get("error") or "the worker gave no answer",
                             trace=out.get("trace"))
            return

    def _restart(self, slot: Slot) -> None:
        """A new worker for `slot` (never raises: where none starts, `slot.proc` is None and
        `slot.start_error` says why; the next job tries again)."""
        if slot.proc is not None:
            slot.proc.kill()
            slot.proc.close()
        slot.proc = None
        if self._stop.is_set():
            return
        slot.restarts += 1
        with self._lock:
            self.counts["worker_restarts"] += 1
        try:
            self._start_worker(slot)
            slot.start_error = None
        except Exception as exc:
            slot.proc, slot.start_error = None, f"{type(exc).__name__}: {exc}"
            time.sleep(1.0)  # not a tight loop of failing starts

    def kill_worker(self, name: str) -> bool:
        """Kill one worker's process (tests, operators): its job is run again on a new one."""
        for slot in self.slots:
            if slot.name == name and slot.proc is not None:
                slot.proc.kill()
                slot.proc.killed = False  # not for a deadline: the job is retried
                return True
        return False

    # -- deadlines and shutdown ---------------------------------------------------------

    def _reap(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for q in (self._build_q, self._device_q):
                for t in q.remove_if(lambda t, now=now: t.deadline <= now or t.done):
                    if not t.done:
                        self._answer(t, DEADLINE, error="passed its deadline while waiting to run")
            for slot in self.slots:
                t, proc = slot.current, slot.running
                if t is not None and proc is not None and t.deadline <= now and not proc.killed:
                    proc.kill()  # its _run_on answers "deadline" and starts a new worker

    @property
    def draining(self) -> bool:
        return self._draining

    def close(self, grace_s: float | None = None) -> None:
        """Drain: refuse new requests, let the accepted ones finish for `grace_s`, answer
        what is left "interrupted", stop the workers."""
        grace = self.cfg.grace_s if grace_s is None else grace_s
        with self._lock:
            self._draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with self._lock:
                busy = self._waiting > 0 or bool(self._inflight)
            if not busy:
                break
            time.sleep(0.1)
        self._stop.set()
        for q in (self._build_q, self._device_q):
            q.close()
            for t in q.remove_if(lambda t: True):
                self._answer(t, INTERRUPTED, error="the service shut down before this request ran")
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.kill()
        for th in self._threads:
            th.join(timeout=15)
        with self._lock:
            left = list(self._inflight.values())
        for t in left:
            self._answer(t, INTERRUPTED, error="the service shut down during this request")

    # -- metrics ------------------------------------------------------------------------

    def _rate_per_s(self, window_s: float) -> float:
        now = time.monotonic()
        span = min(window_s, now - self.started_at)
        if span <= 0:
            return 0.0
        with self._lock:
            n = sum(1 for f in self.finished_at if f >= now - span)
        return n / span

    def metrics(self) -> dict[str, Any]:
        now = time.monotonic()
        up = max(1e-9, now - self.started_at)
        with self._lock:
            lat = sorted(s for _, s in self.latencies)
            counts = dict(self.counts)
            slots = []
            for s in self.slots:
                busy = s.busy_s + (now - s.busy_since if s.busy_since is not None else 0.0)
                slots.append({"name": s.name, "gpu": s.gpu, "busy_fraction": round(busy / up, 4),
                              "evaluations": s.evaluations, "restarts": s.restarts,
                              "running": s.current.id if s.current else None,
                              "pid": s.proc.proc.pid if s.proc and s.proc.proc else None})
            waiting, inflight = self._waiting, len(self._inflight)
            verdicts = dict(self.verdicts)
        return {
            "uptime_s": round(up, 1), "device": self.cfg.device, "draining": self._draining,
            "queue": {"waiting": waiting, "building": len(self._build_q), "ready": len(self._device_q),
                      "running": sum(1 for s in self.slots if s.current is not None), "in_flight": inflight,
                      "max": self.cfg.max_queue},
            "evaluations_per_hour": round(3600 * counts["evaluations"] / up, 1),
            "evaluations_per_hour_recent": round(3600 * self._rate_per_s(600.0), 1),
            "latency_s": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99), "n": len(lat)},
            "counts": counts, "verdicts": verdicts, "workers": slots, "build_workers": self.build_workers,
            "cache": {"entries": len(self._results), "hits": counts["cache_hits"],
                      "joined_in_flight": counts["joined_in_flight"]},
        }

    def progress_line(self) -> str:
        m = self.metrics()
        q = m["queue"]
        busy = " ".join(f"{w['name']} {100 * w['busy_fraction']:.0f}%" for w in m["workers"])
        lat = m["latency_s"]
        return (f"queue {q['waiting']} (building {q['building']}, ready {q['ready']}) running {q['running']} | "
                f"done {m['counts'][DONE]} (cached {m['cache']['hits']}) | {m['evaluations_per_hour']:.0f} evals/h | "
                f"busy {busy} | latency p50 {_s(lat['p50'])} p95 {_s(lat['p95'])}")

    def prefetch(self, tasks: Iterable[Any], options: dict[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, str]:
        """Measure (and cache) the baselines of `tasks` before the requests come: one
        "prefetch" job per task through the device queue, so each is measured by a worker
        in turn with its evaluations. Returns each task's outcome."""
        tickets: list[tuple[str, Ticket]] = []
        for task in tasks:
            req = EvalRequest(task.code, task.name, {"model_new.py": ""}, options=dict(options or {}),
                              mode="prefetch", client="prefetch")
            while True:
                try:
                    tickets.append((task.name, self.submit(req)))
                    break
                except QueueFull:  # a dataset larger than the queue: wait for room
                    pending = [t for _, t in tickets if not t.done]
                    if pending:
                        pending[0].wait(1.0)
                    else:
                        time.sleep(1.0)
        out: dict[str, str] = {}
        for name, t in tickets:
            ans = t.wait() or {}
            out[name] = str(ans.get("baselines") or ans.get("error") or ans.get("status"))
            if progress is not None:
                progress(f"prefetch {name}: {out[name]}")
        return out


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _pct(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return round(sorted_values[k], 3)


@contextlib.contextmanager
def running(cfg: ServiceConfig) -> Any:
    """An engine started for the block, drained and stopped after it."""
    eng = Engine(cfg).start()
    try:
        yield eng
    finally:
        eng.close(grace_s=0)
