"""The agent loop: a model in a workspace, calling tools until it is done.

    state = new episode (workspace, system prompt from SKILL.md, task) or a resumed one
    while no limit is hit:
        make room in the context if needed (oldest tool outputs elided)
        turn = model(messages, tools)
        no tool calls -> done;  each call: parse (malformed -> corrective message), run
        finish -> done
    score the final workspace; keep the best correct state seen; write the summary

Everything the model saw and said goes to the trajectory as it happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cuda_agent.agent import trajectory as T
from cuda_agent.agent.client import (
    Completion,
    ContextFull,
    ModelClient,
    ModelError,
    estimate_tokens,
)
from cuda_agent.agent.service import EvalService, Runner
from cuda_agent.agent.shell import ShellSession
from cuda_agent.agent.tools import SCHEMAS, ToolError, Tools, parse_call
from cuda_agent.files import atomic_write
from cuda_agent.tasks import Task
from cuda_agent.workspace import LOCKED, create_workspace
from cuda_agent.workspace.commands import SOCKET_ENV

SUMMARY_VERSION = 1
CONTROL_PREFIX = "cuda-agent-control-"


def _control_dir() -> Path:
    """A new folder for the episode's evaluation socket (a short path, as a Unix socket needs).

    Its name carries this process's id: a killed episode cannot remove its own, so the next
    one removes those whose process is gone."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(CONTROL_PREFIX + "*-*"):
        pid = old.name[len(CONTROL_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or old.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue
    control = Path(tempfile.mkdtemp(prefix=f"{CONTROL_PREFIX}{os.getpid()}-"))
    control.chmod(0o755)
    return control


@dataclass
class AgentConfig:
    max_turns: int = 200  # model calls (the paper's evaluation setting)
    context_tokens: int = 131_072  # the model's context: prompt + completion must fit
    max_output_tokens: int = 16_384  # per model call, at most what the context has left
    wall_time_s: float = 4 * 3600.0
    max_malformed: int = 3  # consecutive malformed tool calls before the episode ends
    command_timeout_s: float = 600.0
    tool_output_chars: int = 20_000
    keep_recent_messages: int = 8  # never elided
    elide_at: float = 0.85  # elide old tool outputs when the context is this full
    # False: the history is append-only (RL trains on the tokens the model saw); a full
    # context ends the episode instead
    elide: bool = True
    score_every_build: bool = False  # profile each state that compiled
    final_evaluation: bool = True
    sandbox: bool = True
    gpu_index: int | None = None


@dataclass
class EpisodeSummary:
    reason: str
    turns: int
    reward: float
    correct: bool
    speedup_vs_eager: float | None
    speedup_vs_compile: float | None
    best_from: str | None  # "final" or "turn N"
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    task_id: str
    task_name: str
    model: str
    out_dir: str
    final: dict[str, Any] | None = None
    v: int = SUMMARY_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Progress:
    """What the live display shows; the loop updates it and calls `on_update`."""

    turn: int = 0
    last_tool: str = ""
    best_speedup: float | None = None
    best_reward: float | None = None
    tokens: int = 0
    status: str = "starting"
    on_update: Callable[[Progress], None] | None = None

    def update(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)
        if self.on_update is not None:
            self.on_update(self)


def system_prompt(skill: str) -> str:
    return (skill.rstrip() + "\n\n## Working here\n\nYou act only through the tools. The workspace is your current "
            "directory. Call `finish` when your solution is verified and as fast as you can make it; the final "
            "state of model_new.py and kernels/ is what gets scored.\n")


def task_prompt(task: Task, device: str) -> str:
    target = "CUDA kernels" if device == "cuda" else "C++ CPU kernels"
    return (f"Task `{task.name}`: make this PyTorch model faster with custom {target}. It is in model.py "
            f"(locked); write model_new.py and kernels/.\n\n```python\n{task.code.rstrip()}\n```\n")


def initial_messages(task: Task, device: str, skill: str) -> list[dict[str, Any]]:
    """The conversation an episode starts from (also the RL dataset's prompt)."""
    return [{"role": "system", "content": system_prompt(skill)},
            {"role": "user", "content": task_prompt(task, device)}]


class Episode:
    def __init__(self, task: Task, client: ModelClient, out_dir: Path, device: str, config: AgentConfig,
                 progress: Progress | None = None, eval_lock: Any = None, runner: Runner | None = None) -> None:
        self.eval_lock = eval_lock
        self.runner = runner
        self.task, self.client, self.device, self.cfg = task, client, device, config
        self.out = out_dir
        self.ws = out_dir / "workspace"
        self.traj_path = out_dir / "trajectory.jsonl"
        self.best_dir = out_dir / "best"
        self.progress = progress or Progress()
        self.messages: list[dict[str, Any]] = []
        self.turn = 0
        self.context = 0  # tokens of the conversation at the last model call
        self.prompt_total = 0
        self.completion_total = 0
        self.best: dict[str, Any] | None = None
        self.compiled_since_score = False
        self.seconds_before = 0.0

    # ----------------------------------------------------------------- set-up

    def _prepare(self, resume: bool) -> bool:
        """Create or reload the episode; False if the trajectory says it already ended."""
        self.out.mkdir(parents=True, exist_ok=True)
        if resume and self.traj_path.exists():
            st = T.load(self.traj_path)
            if st.start is None:
                raise ValueError(f"{self.traj_path} has no start event; it is not a trajectory of this tool")
            if st.start["task"]["id"] != self.task.id:
                raise ValueError(f"{self.traj_path} is an episode of task {st.start['task']['name']}, "
                                 f"not of {self.task.name}")
            if st.end is not None:
                return False
            self.messages, self.turn = st.messages, st.turns
            self.context = st.prompt_tokens
            self.prompt_total, self.completion_total = st.prompt_tokens_total, st.completion_tokens_total
            self.seconds_before = st.seconds
            for e in st.evaluations:
                self._consider(e.get("result"), e.get("turn", 0), save=False)
            self.writer = T.TrajectoryWriter(self.traj_path)
            self.writer.event("resume", self.turn, dropped=st.dropped, seconds_before=round(st.seconds, 3))
            if not self.ws.exists():
                raise ValueError(f"{self.ws} is gone; the episode cannot be resumed")
            return True
        if self.traj_path.exists():
            raise ValueError(f"{self.traj_path} exists: pass --resume to continue that episode, or another --out")
        create_workspace(self.task, self.ws, self.device)
        self.writer = T.TrajectoryWriter(self.traj_path)
        cfg = asdict(self.cfg)
        self.writer.event("start", 0, task={"id": self.task.id, "name": self.task.name, "source": self.task.source,
                                            "code": self.task.code},
                          device=self.device, model=self.client.name, config=cfg, workspace=str(self.ws))
        for msg in initial_messages(self.task, self.device, (self.ws / "SKILL.md").read_text()):
            self._append(msg)
        return True

    def _append(self, msg: dict[str, Any]) -> None:
        self.messages.append(msg)
        self.writer.event("message", self.turn, message=msg)

    # ----------------------------------------------------------------- evaluations and the best state

    def _score_key(self, rec: dict[str, Any]) -> tuple[float, float]:
        return float(rec.get("reward", -1)), float(rec.get("speedup_vs_compile") or 0.0)

    def _consider(self, rec: dict[str, Any] | None, turn: int, save: bool = True, source: str | None = None) -> None:
        if not rec or not rec.get("correct"):
            return
        if self.best is None or self._score_key(rec) > self._score_key(self.best["result"]):
            self.best = {"result": rec, "from": source or f"turn {turn}"}
            if save:
                self._snapshot(self.best_dir)
            self.progress.update(best_speedup=rec.get("speedup_vs_compile"), best_reward=rec.get("reward"))

    def _snapshot(self, dest: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".best-", dir=self.out))
        for name in ("model_new.py",):
            if (self.ws / name).is_file():
                shutil.copy2(self.ws / name, tmp / name)
        if (self.ws / "kernels").is_dir():
            shutil.copytree(self.ws / "kernels", tmp / "kernels",
                            ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)

    def _on_command(self, name: str, argv: list[str], rc: int, text: str, result: Any) -> None:
        if name == "prefetch":  # the service's start-up work (baselines, headers), not the agent's
            self.writer.event("prefetch", self.turn, **(result if isinstance(result, dict) else {}))
            return
        rec = result.to_dict() if hasattr(result, "to_dict") and hasattr(result, "correct") else None
        self.writer.event("evaluation", self.turn, command=name, argv=argv, rc=rc, source="agent",
                          result=rec, output=text[-4000:])
        if name == "compile" and rc == 0:
            self.compiled_since_score = True
        if name == "profiling":
            self._consider(rec, self.turn)

    async def _score(self, source: str) -> dict[str, Any] | None:
        """Profile the workspace as it is now (outside the agent's view)."""
        box: dict[str, Any] = {}

        def listener(name: str, argv: list[str], rc: int, text: str, result: Any) -> None:
            box["rec"] = result.to_dict() if hasattr(result, "to_dict") and hasattr(result, "correct") else None
            box["rc"], box["text"] = rc, text

        prev = self.service.listener
        self.service.listener = listener
        try:
            await asyncio.to_thread(self.service.run, "profiling", [])
        finally:
            self.service.listener = prev
        rec = box.get("rec")
        self.writer.event("evaluation", self.turn, command="profiling", argv=[], rc=box.get("rc"), source=source,
                          result=rec, output=(box.get("text") or "")[-4000:])
        self._consider(rec, self.turn, source="final" if source == "final" else None)
        return rec

    # ----------------------------------------------------------------- context

    def _estimate(self) -> int:
        """Tokens of the conversation now: the last call's count plus what came since."""
        if self.context <= 0:
            return sum(estimate_tokens(m) for m in self.messages) + estimate_tokens(SCHEMAS)
        since = 0
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                break
            since += estimate_tokens(m)
        return self.context + since

    def _make_room(self) -> bool:
        """Elide the oldest tool outputs until the context fits; False if it cannot."""
        budget = int(self.cfg.elide_at * self.cfg.context_tokens)
        est = self._estimate()
        if est <= budget:
            return True
        if not self.cfg.elide:
            return est + 256 < self.cfg.context_tokens
        protected = max(2, len(self.messages) - self.cfg.keep_recent_messages)
        done: list[int] = []
        for i in range(2, protected):
            m = self.messages[i]
            if m.get("role") != "tool" or (m.get("content") or "").startswith("[output elided"):
                continue
            n = len(m.get("content") or "")
            if n < 200:
                continue
            saved = estimate_tokens(m.get("content") or "") - estimate_tokens(T.ELIDED.format(n=n))
            m["content"] = T.ELIDED.format(n=n)
            done.append(i)
            est -= saved
            self.context = max(0, self.context - saved)
            if est <= budget:
                break
        if done:
            self.writer.event("elide", self.turn, indices=done)
        return est + 256 < self.cfg.context_tokens

    # ----------------------------------------------------------------- the loop

    async def run(self, resume: bool = False) -> EpisodeSummary:
        if not self._prepare(resume):
            return self._summary_from_file()
        control = _control_dir()
        # evaluations elsewhere measure the baselines where they run, not here
        self.service = EvalService(self.ws, control, sandbox=self.cfg.sandbox, listener=self._on_command,
                                   device_lock=self.eval_lock, runner=self.runner, prefetch=self.runner is None)
        self.service.start()
        locked = [(self.ws / name, str(self.ws / name)) for name in LOCKED if (self.ws / name).exists()]
        from cuda_agent.evaluator.processes import python_env

        # PYTHONPATH too: the workspace commands import cuda_agent also where it is not installed
        env = {SOCKET_ENV: str(self.service.path), "CUDA_AGENT_WORKSPACE": str(self.ws),
               "PYTHONPATH": python_env(self.device)["PYTHONPATH"]}
        shell = ShellSession(self.ws, control, readonly=[*locked, (control, str(control))], env=env,
                             sandbox=self.cfg.sandbox, gpu_index=self.cfg.gpu_index)
        tools = Tools(self.ws, shell, command_timeout_s=self.cfg.command_timeout_s,
                      max_output_chars=self.cfg.tool_output_chars)
        t0 = time.monotonic()
        reason = "unknown"
        summary: EpisodeSummary | None = None
        try:
            reason = await self._loop(tools, t0)
        except (KeyboardInterrupt, asyncio.CancelledError):
            reason = "interrupted"
            raise
        finally:
            shell.close()
            if reason != "interrupted":
                final = None
                if self.cfg.final_evaluation:
                    self.progress.update(status="final evaluation")
                    final = await self._score("final")
                summary = self._finish(reason, final, time.monotonic() - t0)
            self.service.close()
            shutil.rmtree(control, ignore_errors=True)
            self.writer.close()
        assert summary is not None
        return summary

    async def _loop(self, tools: Tools, t0: float) -> str:
        malformed = 0
        while True:
            if self.turn >= self.cfg.max_turns:
                return "max-turns"
            if self.seconds_before + time.monotonic() - t0 > self.cfg.wall_time_s:
                return "wall-time"
            if not self._make_room():
                return "context-full"
            room = self.cfg.context_tokens - self._estimate()
            self.turn += 1
            self.progress.update(turn=self.turn, status="waiting for the model")
            try:
                c: Completion = await self.client.complete(self.messages, SCHEMAS,
                                                           max_tokens=max(1, min(self.cfg.max_output_tokens, room)))
            except ModelError as exc:
                self.writer.event("model", self.turn, error=str(exc))
                return "context-full" if isinstance(exc, ContextFull) else "model-error"
            self.writer.event("model", self.turn, prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                              latency_s=round(c.latency_s, 4), finish_reason=c.finish_reason,
                              **({"reasoning": c.reasoning} if c.reasoning else {}))
            self.prompt_total += c.prompt_tokens
            self.completion_total += c.completion_tokens
            self.context = c.prompt_tokens + c.completion_tokens
            self._append(c.message())
            self.progress.update(tokens=self.prompt_total + self.completion_total)
            if not c.tool_calls:
                return "length" if c.finish_reason == "length" else "no-tool-call"
            finish = False
            bad_turn = False
            for call in c.tool_calls:
                t_call = time.monotonic()
                try:
                    args = parse_call(call.name, call.arguments)
                except ToolError as exc:
                    bad_turn = True
                    out = (f"Error: malformed tool call: {exc}. Call one of the tools with a JSON object of its "
                           "arguments.")
                    self.writer.event("tool", self.turn, call_id=call.id, name=call.name, arguments=call.arguments,
                                      ok=False, malformed=True, seconds=0.0)
                    self._append({"role": "tool", "tool_call_id": call.id, "content": out})
                    continue
                self.progress.update(last_tool=call.name, status=f"running {call.name}")
                res = await tools.call(call.name, args)
                self.writer.event("tool", self.turn, call_id=call.id, name=call.name, arguments=args, ok=res.ok,
                                  seconds=round(time.monotonic() - t_call, 4), meta=res.meta)
                self._append({"role": "tool", "tool_call_id": call.id, "content": res.output})
                finish = finish or res.finish
            malformed = malformed + 1 if bad_turn else 0
            if finish:
                return "finish"
            if malformed >= self.cfg.max_malformed:
                return "malformed-tool-calls"
            if self.cfg.score_every_build and self.compiled_since_score:
                self.compiled_since_score = False
                self.progress.update(status="scoring the build")
                await self._score("score")

    # ----------------------------------------------------------------- the end

    def _finish(self, reason: str, final: dict[str, Any] | None, seconds: float) -> EpisodeSummary:
        best = self.best["result"] if self.best else None
        s = EpisodeSummary(
            reason=reason, turns=self.turn, reward=float(best["reward"]) if best else -1.0,
            correct=bool(best), speedup_vs_eager=best.get("speedup_vs_eager") if best else None,
            speedup_vs_compile=best.get("speedup_vs_compile") if best else None,
            best_from=self.best["from"] if self.best else None, prompt_tokens=self.prompt_total,
            completion_tokens=self.completion_total, seconds=round(self.seconds_before + seconds, 3),
            task_id=self.task.id, task_name=self.task.name, model=self.client.name, out_dir=str(self.out),
            final={k: final.get(k) for k in ("status", "correct", "reward", "message", "rule", "speedup_vs_eager",
                                              "speedup_vs_compile", "flags")} if final else None)
        self.writer.event("end", self.turn, **{k: v for k, v in s.to_dict().items() if k != "v"})
        atomic_write(self.out / "summary.json", json.dumps(s.to_dict(), indent=1))
        self.progress.update(status=f"done: {reason}")
        return s

    def _summary_from_file(self) -> EpisodeSummary:
        data = json.loads((self.out / "summary.json").read_text())
        data.pop("v", None)
        return EpisodeSummary(**data)


async def run_episode(task: Task, client: ModelClient, out_dir: str | Path, *, device: str = "cuda",
                      config: AgentConfig | None = None, resume: bool = False,
                      progress: Progress | None = None, eval_lock: Any = None,
                      runner: Runner | None = None) -> EpisodeSummary:
    """Run (or resume) one episode of `client` on `task`; everything goes under `out_dir`.
    `eval_lock` (shared by episodes on one device) makes their verifications and timings
    take turns on it; `runner` runs the workspace commands elsewhere (evaluation workers)."""
    ep = Episode(task, client, Path(out_dir).resolve(), device, config or AgentConfig(), progress, eval_lock,
                 runner)
    return await ep.run(resume=resume)
