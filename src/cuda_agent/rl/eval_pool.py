"""Rewards away from the training GPUs: an episode's workspace commands on Ray evaluation actors.

The training nodes hold the actor, the critic and the inference servers; kernels are
verified and timed on evaluation nodes, started with a custom resource:

    ray start --address=HEAD:6379 --num-gpus=0 --resources='{"kernel_eval_gpu": 8}'  # an 8-GPU eval node

(`--num-gpus=0`: verl's training workers must not be placed on an evaluation node.)

One `EvalWorker` actor per unit of that resource. On its node each worker claims one GPU
(the lowest free device index, by a lock file) and keeps it for its life, so two workers
never time on one GPU; its evaluations are the usual sandboxed evaluator processes, warm
spares and the node's baseline and build caches included (put `CUDA_AGENT_CACHE` on
storage all evaluation nodes share to share them across nodes). Compiles go to build
workers on the same node (CPU only); a request carries the solution's files, and an
episode keeps to one node, so its verification finds the content-hashed build its compile
left there.

An episode's `EvalService` gets `ray_runner(settings)` as its runner: a command reads the
solution files from the workspace, sends them with the trusted task record to the next
free worker, and hands back the text and the result record, as the local runner would. A
worker that dies mid-request (a candidate that took its node's process down, the node
lost) is restarted by Ray; the request is retried once on another worker, then reported
as an evaluator error, and the episode goes on.
"""

from __future__ import annotations

import fcntl
import glob
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from cuda_agent.rl.settings import EvalPoolSettings

KEEP_WORKSPACES = 64  # a worker keeps this many episodes' workspaces (incremental builds)
IDLE_EXIT_S = 1800.0  # a (detached) worker with no request for this long leaves
_SLOT_DIR = Path(tempfile.gettempdir()) / "cuda-agent-eval-gpus"


def _claim_gpu() -> tuple[int, Any]:
    """The lowest GPU index of this node no other worker holds, and its held lock."""
    n = len([p for p in glob.glob("/dev/nvidia[0-9]*") if os.path.basename(p)[6:].isdigit()])
    _SLOT_DIR.mkdir(parents=True, exist_ok=True)
    for k in range(max(n, 1)):
        fh = open(_SLOT_DIR / f"gpu-{k}.lock", "a")  # noqa: SIM115 (held for the worker's life)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return k, fh
        except BlockingIOError:
            fh.close()
    raise RuntimeError(f"every GPU of this node ({n}) is held by another evaluation worker: start the node "
                       "with no more units of the evaluation resource than it has GPUs")


class EvalWorker:
    """Evaluates workspace commands sent as requests (see `request`); a Ray actor's class."""

    def __init__(self, sandbox: bool = True, role: str = "gpu") -> None:
        self.sandbox = sandbox
        self.role = role  # "gpu": verifies and times on its GPU; "build": compiles
        self.root = Path(tempfile.mkdtemp(prefix="cuda-agent-eval-"))
        self.workspaces: OrderedDict[str, Path] = OrderedDict()
        self.gpu: int | None = None
        self._gpu_lock: Any = None
        self._lock = threading.Lock()
        self.commands: dict[str, int] = {}
        self.last = time.monotonic()
        threading.Thread(target=self._leave_when_idle, daemon=True).start()

    def _leave_when_idle(self) -> None:
        while True:
            time.sleep(min(60.0, IDLE_EXIT_S / 4))
            with self._lock:
                if time.monotonic() - self.last > IDLE_EXIT_S:
                    shutil.rmtree(self.root, ignore_errors=True)
                    os._exit(0)

    def stats(self) -> dict[str, Any]:
        """Commands run so far by name, and the GPU held."""
        return {"role": self.role, "commands": dict(self.commands), "gpu": self.gpu, "pid": os.getpid()}

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def _workspace(self, req: dict[str, Any]) -> Path:
        from cuda_agent.tasks import task_from_code
        from cuda_agent.workspace import create_workspace, remove_workspace

        key = str(req["episode"])
        ws = self.workspaces.get(key)
        if ws is None:
            t = req["task"]
            ws = create_workspace(task_from_code(t["code"], name=t["name"], source=t["source"]),
                                  self.root / f"ws-{len(self.workspaces)}-{os.getpid()}-{key[:16]}", req["device"])
            self.workspaces[key] = ws
            while len(self.workspaces) > KEEP_WORKSPACES:
                remove_workspace(self.workspaces.popitem(last=False)[1])
        self.workspaces.move_to_end(key)
        # the episode's solution files exactly: stale kernels removed, the rest rewritten
        kernels = ws / "kernels"
        shutil.rmtree(kernels, ignore_errors=True)
        kernels.mkdir()
        for rel, text in req["files"].items():
            if rel != "model_new.py" and not rel.startswith("kernels/"):
                continue
            dest = (ws / rel).resolve()
            if ws.resolve() not in dest.parents:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        return ws

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        from cuda_agent.workspace.commands import run_command

        with self._lock:  # one evaluation at a time: the GPU is this worker's alone
            if req["device"] == "cuda" and self.gpu is None and self.role == "gpu":
                self.gpu, self._gpu_lock = _claim_gpu()
            self.last = time.monotonic()
            ws = self._workspace(req)
            parts: list[str] = []
            self.commands[req["command"]] = self.commands.get(req["command"], 0) + 1
            rc, result = run_command(req["command"], ws, list(req["argv"]), parts.append, sandbox=self.sandbox,
                                     warm=True, gpu_index=self.gpu)
            self.last = time.monotonic()
        rec = result.to_dict() if hasattr(result, "to_dict") and hasattr(result, "correct") else None
        return {"rc": rc, "output": "".join(parts), "result": rec, "gpu": self.gpu, "node": os.uname().nodename}


def request(ws: Path, episode: str, name: str, argv: list[str]) -> dict[str, Any]:
    """What a worker needs to run `name` on workspace `ws`: the trusted task record and the
    solution's files (read as the evaluator reads them: bounded, no links followed)."""
    from cuda_agent.evaluator.solution import load_solution
    from cuda_agent.workspace import load_record

    rec = load_record(ws)
    return _request(episode, name, argv, rec.device, load_solution(ws).files, rec.task)


def _request(episode: str, name: str, argv: list[str], device: str, files: dict[str, str],
             task: Any) -> dict[str, Any]:
    return {"episode": episode, "command": name, "argv": list(argv), "device": device, "files": dict(files),
            "task": {"code": task.code, "name": task.name, "source": task.source}}


class RayPool:
    """The evaluation actors of the cluster, shared by every process that opens the pool.

    Actors are named (`cuda-agent-eval-JOB-RESOURCE-K`, `cuda-agent-build-JOB-RESOURCE-NODE-J`),
    so the agent-loop workers of a training job, each opening the pool, find the same ones
    rather than each asking for the whole resource. Per evaluation node there are the GPU
    workers (one unit of the resource each) and `build_workers` build workers (one CPU
    each, on that node, no GPU): compiles go to the build workers, so a GPU never idles
    behind a build. An episode sticks to one node, so its verification finds the build
    its compile left in that node's cache."""

    def __init__(self, settings: EvalPoolSettings, sandbox: bool = True) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, ignore_reinit_error=True,
                     include_dashboard=False, log_to_driver=False)
        self.sandbox = sandbox
        res = self.resource = settings.resource
        n = settings.workers or int(ray.cluster_resources().get(res, 0))
        if n < 1:
            raise ValueError(f"the Ray cluster has no {res!r} resource: start the evaluation nodes with "
                             f"ray start --num-gpus=0 --resources='{{\"{res}\": GPUS}}'")
        self._job = ray.get_runtime_context().get_job_id()
        self._guard = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._busy: dict[str, int] = {}  # requests in flight from this process, by actor name
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self.groups: dict[str, dict[str, list[str]]] = {}
        gpu_names = [f"cuda-agent-eval-{self._job}-{res}-{k}" for k in range(n)]
        nodes = ray.get([self._actor(name).node.remote() for name in gpu_names])
        for name, node in zip(gpu_names, nodes, strict=True):
            self.groups.setdefault(node, {"gpu": [], "build": []})["gpu"].append(name)
        for node, g in self.groups.items():
            g["build"] = [f"cuda-agent-build-{self._job}-{res}-{node[:16]}-{j}" for j in range(settings.build_workers)]
            for name in g["build"]:
                self._actor(name)

    @property
    def actors(self) -> list[Any]:
        return [self._actor(name) for g in self.groups.values() for name in g["gpu"] + g["build"]]

    def _actor(self, name: str, fresh: bool = False) -> Any:
        """The named actor, created if there is none (or the one there died). Detached: an
        actor must not die with the agent-loop worker that happened to create it first; one
        idle for `IDLE_EXIT_S` leaves by itself, and is made again when next needed."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._guard:
            if name in self._handles and not fresh:
                return self._handles[name]
        build = name.startswith("cuda-agent-build-")
        opts: dict[str, Any] = {"name": name, "get_if_exists": True, "lifetime": "detached",
                                "max_restarts": 0, "max_task_retries": 0, "num_cpus": 1}
        if build:
            node = next(nd for nd, g in self.groups.items() if name in g["build"])
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        else:
            opts["resources"] = {self.resource: 1}
        handle = ray.remote(EvalWorker).options(**opts).remote(self.sandbox, "build" if build else "gpu")
        with self._guard:
            self._handles[name] = handle
            self._busy.setdefault(name, 0)
        return handle

    def _choose(self, req: dict[str, Any]) -> str:
        with self._guard:
            node = self._sticky.get(req["episode"])
            if node is None:  # the least busy node, as this process sees it
                node = min(self.groups, key=lambda nd: sum(self._busy[a] for a in self.groups[nd]["gpu"]))
            self._sticky[req["episode"]] = node
            self._sticky.move_to_end(req["episode"])
            while len(self._sticky) > 100_000:
                self._sticky.popitem(last=False)
            g = self.groups[node]
            group = g["build"] if req["command"] == "compile" and g["build"] else g["gpu"]
            name = min(group, key=lambda a: self._busy[a])
            self._busy[name] += 1
            return name

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        """Run one request; if its worker died (a lost node, a worker that left when idle, a
        process taken down), the worker is made again and the request retried once."""
        import ray

        err: Exception | None = None
        for attempt in range(2):
            name = self._choose(req)
            try:
                return ray.get(self._actor(name, fresh=attempt > 0).run.remote(req))
            except ray.exceptions.RayError as exc:
                err = exc
            finally:
                with self._guard:
                    self._busy[name] -= 1
        raise RuntimeError(f"the evaluation worker died twice running this command ({type(err).__name__}: "
                           f"{str(err)[:300]})")


_POOLS: dict[tuple[str, int, int, bool], RayPool] = {}
_POOLS_LOCK = threading.Lock()
_episodes = itertools.count()


def ray_pool(settings: EvalPoolSettings, sandbox: bool = True) -> RayPool:
    """One pool per process and settings (every episode of an agent-loop worker shares it)."""
    key = (settings.resource, settings.workers, settings.build_workers, sandbox)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = RayPool(settings, sandbox)
        return _POOLS[key]


def ray_runner(settings: EvalPoolSettings, sandbox: bool = True) -> Any:
    """A runner for `EvalService` (see `agent.service.Runner`) sending commands to the pool."""
    from cuda_agent.evaluator.record import EvalResult
    from cuda_agent.evaluator.solution import SolutionError
    from cuda_agent.workspace import WorkspaceError

    pool = ray_pool(settings, sandbox)
    episodes: dict[str, str] = {}

    def run(name: str, ws: Path, argv: list[str], emit: Any, sandbox_: bool, warm: bool) -> tuple[int, Any]:
        episode = episodes.setdefault(str(ws), f"{os.getpid()}-{next(_episodes)}")
        try:
            req = request(ws, episode, name, argv)
        except (SolutionError, WorkspaceError) as exc:
            emit(f"[FAIL] {exc}\n")
            return 1, None
        reply = pool.run(req)
        emit(reply["output"])
        return int(reply["rc"]), EvalResult.from_dict(reply["result"]) if reply["result"] else None

    return run


def profile_files(settings: EvalPoolSettings, task: Any, device: str, files: dict[str, str],
                  sandbox: bool = True) -> tuple[str, Any]:
    """`utils.profiling` of a solution given as files (the single-turn stage's responses) on
    the pool: its text and result record (an `EvalResult`, None if it was not evaluated)."""
    from cuda_agent.evaluator.record import EvalResult
    from cuda_agent.evaluator.solution import solution_from_files

    req = _request(f"files-{solution_from_files(files).content_hash}", "profiling", [], device, files, task)
    reply = ray_pool(settings, sandbox).run(req)
    return reply["output"], EvalResult.from_dict(reply["result"]) if reply["result"] else None
