"""`cuda-agent datagen`: compose candidate tasks, filter them, write the dataset.

Candidate `i` is composed from its own random stream (seed, i), so a run is reproducible
and `--resume` continues where it stopped without duplicates: every candidate ends as one
line, in the dataset (`OUT.jsonl`) or in the rejects (`OUT.rejects.jsonl`, with the stage
that rejected it and why). At the end `OUT.parquet` is written from the JSONL.

Filters, each a named stage whose rejects are counted:
  parse          the code is a valid task (Model, get_inputs, get_init_inputs)
  stochastic     no random operator in the Model (dropout, rand*, bernoulli, ...)
  duplicate      not the same code as an accepted task
  decontaminate  AST similarity to every benchmark task <= threshold (similarity.py)
  runs, deterministic, nontrivial, compile   run in a sandboxed process (check.py)
  calibrate      (before those) the batch size is scaled until a quick eager timing lands
                 in [min_ms, max_ms], so sizes fit the target device; the task is written
                 with the calibrated size (`--no-calibrate`: keep the composer's sizes)
  runtime        eager time within [min_ms, max_ms] with the evaluator's timing protocol;
                 a quick timing more than 2x outside the range rejects before the compile
                 stage, which is most of a task's cost
"""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent.datagen.compose import (
    PUBLISHED_MIX,
    Composed,
    compose_llm,
    compose_offline,
    compose_transformers,
    normalised_mix,
    sample_n_ops,
)
from cuda_agent.datagen.similarity import Reference, model_class
from cuda_agent.paths import cache_dir
from cuda_agent.tasks import TaskError, load_tasks, task_from_code

STAGES = ("compose", "parse", "stochastic", "duplicate", "decontaminate", "runs", "calibrate", "deterministic", "nontrivial",
          "compile", "runtime")
# Random modules anywhere in the Model; random calls outside __init__ (a seeded random
# initialisation of parameters is deterministic, and the evaluator seeds it).
_STOCHASTIC_MODULES = re.compile(r"\b(Dropout\w*|AlphaDropout|FeatureAlphaDropout|RReLU)\b")
_STOCHASTIC_CALLS = re.compile(r"\b(dropout\w*|rrelu|bernoulli\w*|multinomial|rand|randn|randint|rand_like|"
                               r"randn_like|randint_like|randperm|normal_|uniform_|exponential_|cauchy_|geometric_|"
                               r"log_normal_|random_|poisson)\b")


@dataclass
class DatagenConfig:
    n: int = 100
    seed: int = 0
    composer: str = "offline"  # or "llm"
    mix: dict[int | str, float] = field(default_factory=lambda: dict(PUBLISHED_MIX))
    device: str = "cpu"
    gpu_index: int = 0
    min_ms: float = 1.0
    max_ms: float = 100.0
    runtime_filter: bool = True
    calibrate: bool = True  # scale the batch size into the runtime range before filtering
    max_input_mb: float = 2048.0  # calibration never makes the inputs larger than this
    compile_filter: bool = True
    decontaminate: Path | None = None
    threshold: float = 0.9
    workers: int = 1
    scale: float = 1.0  # input sizes times this (small tasks for CPU runs)
    sandbox: bool = True
    timeout_s: float = 300.0
    threads: int | None = None
    llm: Any = None  # a ModelClient for composer "llm"
    max_candidates: int | None = None  # stop after this many candidates (default 20 n)
    # Timings take the device one worker at a time (default: on CUDA, where workers share
    # one GPU; CPU workers time on their own cores).
    exclusive_timing: bool | None = None
    time_limit_s: float | None = None  # start no new candidate after this long (--resume continues)


@dataclass
class Summary:
    produced: int = 0
    candidates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    n_ops: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    stopped_by_time: bool = False


def stochastic_in_model(code: str) -> str | None:
    node = model_class(code)
    if node is None:
        return None
    m = _STOCHASTIC_MODULES.search(ast.get_source_segment(code, node) or "")
    if m:
        return m.group(1)
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name != "__init__":
            m = _STOCHASTIC_CALLS.search(ast.get_source_segment(code, item) or "")
            if m:
                return m.group(1)
    return None


_BATCH_NAMES = ("batch_size", "batch", "bs", "N", "B")


def batch_variable(code: str) -> str | None:
    """The module-level integer that sets the batch size (`batch_size = 16`), if any."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    found = {t.id for node in tree.body if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and type(node.value.value) is int
             for t in node.targets if isinstance(t, ast.Name)}
    return next((n for n in _BATCH_NAMES if n in found), None)


def with_size(code: str, var: str, value: int) -> str:
    """`code` with the module-level `var = N` line set to `value`."""
    return re.sub(rf"^{re.escape(var)}\s*=\s*\d+[ \t]*$", f"{var} = {value}", code, count=1, flags=re.M)


def _check(code: str, cfg: DatagenConfig) -> dict[str, Any]:
    """Run the sandboxed stages; returns check.py's result (or a failure of `runs`)."""
    from cuda_agent import sandbox
    from cuda_agent.evaluator.processes import BASELINE_PRELOAD, preload, python_env

    with tempfile.TemporaryDirectory(prefix="datagen-") as d:
        work = Path(d)
        (work / "task.py").write_text(code)
        (work / "out").mkdir()
        # Deciding whether eager lies inside the runtime range needs a 2% CI, not the reward's
        # 0.5%: on CUDA the device-time rule is read every 20 rounds (or half a second).
        proto = {"warmup": 3, "min_iters": 10, "max_iters": 100, "target_rel_ci": 0.02, "budget_s": 5.0,
                 "chunk": 20, "target_device_rel_ci": 0.02}
        spec = {"task": str(work / "task.py"), "out": str(work / "out"), "device": cfg.device,
                "compile": cfg.compile_filter, "runtime": cfg.runtime_filter, "protocol": proto,
                "threads": cfg.threads}
        if cfg.runtime_filter:
            spec["runtime_range"] = [cfg.min_ms, cfg.max_ms]
        var = batch_variable(code) if cfg.calibrate and cfg.runtime_filter else None
        if var:
            spec["calibrate"] = {"var": var, "min_ms": cfg.min_ms, "max_ms": cfg.max_ms,
                                 "max_input_bytes": int(cfg.max_input_mb * (1 << 20))}
        readonly: list[Path] = []
        if cfg.exclusive_timing if cfg.exclusive_timing is not None else cfg.device == "cuda":
            # flock needs only a read-only descriptor: the lock file is bound read-only, so
            # runs as different sandbox uids share it and the task cannot replace it.
            lock = cache_dir("datagen-locks") / f"datagen-{cfg.device}{cfg.gpu_index if cfg.device == 'cuda' else ''}.lock"
            lock.touch()
            spec["device_lock"] = str(lock)
            readonly.append(lock)
        (work / "spec.json").write_text(json.dumps(spec))
        conf = sandbox.SandboxConfig(enabled=cfg.sandbox, timeout_s=cfg.timeout_s,
                                     gpu_index=cfg.gpu_index if cfg.device == "cuda" else None)
        env = python_env(cfg.device, cfg.threads)
        cache = work / "inductor"
        cache.mkdir()
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
        r = sandbox.run([sys.executable, "-m", "cuda_agent.datagen.check", str(work / "spec.json")], cwd=work,
                        writable=[work], readonly=readonly, env=env, config=conf, preload=preload(BASELINE_PRELOAD, cfg.device))
        try:
            return json.loads((work / "out" / "result.json").read_text())
        except (OSError, ValueError):
            why = r.describe() + ": " + (r.stderr or r.stdout)[-600:]
            return {"stages": {"runs": {"ok": False, "why": why}}}


class Generator:
    def __init__(self, cfg: DatagenConfig, out: Path, *, resume: bool = False,
                 on_update: Callable[[Summary], None] | None = None) -> None:
        self.cfg = cfg
        self.out = out
        self.rejects = out.with_name(out.stem + ".rejects.jsonl")
        self.mix = normalised_mix(cfg.mix)
        self.summary = Summary()
        self.on_update = on_update
        self.lock = threading.Lock()
        self.done: set[int] = set()
        self.ids: set[str] = set()
        out.parent.mkdir(parents=True, exist_ok=True)
        self._loop: asyncio.AbstractEventLoop | None = None  # one event loop for the LLM client's calls
        if out.exists() or self.rejects.exists():
            if not resume:
                raise ValueError(f"{out} (or its rejects) exists: pass --resume to continue, or another output")
            self._reload()
        self.reference = self._reference()

    def _reload(self) -> None:
        for path, accepted in ((self.out, True), (self.rejects, False)):
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                self.done.add(int(row["index"]))
                if accepted:
                    self.ids.add(row["task_id"])
                    self._count(row)
                else:
                    self.summary.rejected[row["stage"]] += 1
                self.summary.candidates += 1

    def _reference(self) -> Reference | None:
        if self.cfg.decontaminate is None:
            return None
        root = Path(self.cfg.decontaminate)
        tasks = load_tasks(root)
        base = root.resolve() if root.is_dir() else None

        def name(t: Any) -> str:
            # relative to the benchmark's folder (e.g. level2/66_...py): the dataset's rows
            # name the closest benchmark task, not a path on the machine that made them
            if base is None:
                return f"{root.name}:{t.name}"
            try:
                return Path(str(t.source)).resolve().relative_to(base).as_posix()
            except ValueError:
                return t.name

        return Reference.from_codes([(name(t), t.code) for t in tasks])

    def _count(self, row: dict[str, Any]) -> None:
        self.summary.produced += 1
        self.summary.n_ops[str(row["n_ops"]) if row["data_source"].startswith(("torch", "llm")) else "transformers"] += 1
        for op in row["ops"]:
            self.summary.ops[op] += 1

    def _compose(self, i: int) -> Composed | None:
        rng = random.Random(f"{self.cfg.seed}:{i}")
        k = sample_n_ops(rng, self.mix)
        if k == "transformers":
            return compose_transformers(rng, self.cfg.scale)
        if self.cfg.composer == "llm":
            with self.lock:
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                    threading.Thread(target=self._loop.run_forever, daemon=True, name="cuda-agent-llm").start()
            fut = asyncio.run_coroutine_threadsafe(compose_llm(self.cfg.llm, rng, int(k)), self._loop)
            return fut.result()
        return compose_offline(rng, int(k), scale=self.cfg.scale)

    def _write(self, path: Path, row: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def _reject(self, row: dict[str, Any], stage: str, why: str, **extra: Any) -> None:
        with self.lock:
            self._write(self.rejects, {**row, "stage": stage, "why": why[:1000], **extra})
            self.summary.rejected[stage] += 1
            self.summary.candidates += 1
        if self.on_update:
            self.on_update(self.summary)

    def process(self, i: int) -> None:
        row: dict[str, Any] = {"index": i, "seed": self.cfg.seed}
        try:
            c = self._compose(i)
        except Exception as exc:  # a model that fails to answer, a composer bug: a reject, not a crash
            self._reject(row, "compose", f"{type(exc).__name__}: {exc}")
            return
        if c is None:
            self._reject(row, "compose", "no consistent composition (or no task in the model's reply)")
            return
        self.process_composed(i, c)

    def process_composed(self, i: int, c: Composed) -> None:
        """Filter one composed candidate; it ends in the dataset or in the rejects."""
        cfg = self.cfg
        row: dict[str, Any] = {"index": i, "seed": cfg.seed}

        def reject(stage: str, why: str, **extra: Any) -> None:
            self._reject(row, stage, why, **extra)

        row.update(ops=c.ops, n_ops=c.n_ops, data_source=c.data_source, composer=c.composer)
        try:
            task = task_from_code(c.code, name=f"gen_{i}", source="<datagen>")
        except TaskError as exc:
            reject("parse", str(exc), code=c.code)
            return
        row["task_id"] = task.id
        bad = stochastic_in_model(c.code)
        if bad:
            reject("stochastic", f"the Model uses {bad}", code=c.code)
            return
        with self.lock:
            if task.id in self.ids:
                dup = True
            else:
                dup = False
                self.ids.add(task.id)  # claimed; released if a later stage rejects it
        if dup:
            reject("duplicate", "the same code as an accepted task")
            return
        prov: dict[str, Any] = {"parse": "ok", "stochastic": "none", "duplicate": "unique"}
        code = c.code
        try:
            if self.reference is not None:
                sim, name = self.reference.closest(c.code)
                prov["decontaminate"] = {"max_similarity": round(sim, 4), "closest": name}
                if sim > cfg.threshold:
                    raise _Rejected("decontaminate", f"AST similarity {sim:.3f} to {name} (threshold {cfg.threshold})")
            res = _check(code, cfg)
            cal = res["stages"].get("calibrate") or {}
            resized = bool(cal.get("to")) and cal["to"] != cal.get("from")
            for stage in ("runs", "calibrate", "deterministic", "nontrivial", "compile", "runtime"):
                st = res["stages"].get(stage)
                if st is None:
                    continue
                if not st.get("ok"):  # (a resized task says at which size it was rejected)
                    raise _Rejected(stage, st.get("why", "failed"), **({"calibrate": cal} if resized else {}))
                prov[stage] = {k: v for k, v in st.items() if k not in ("ok",)} or "ok"
            if resized:
                code = with_size(code, cal["var"], int(cal["to"]))
                sized = task_from_code(code, name=f"gen_{i}", source="<datagen>")
                with self.lock:
                    self.ids.discard(task.id)
                    dup = sized.id in self.ids
                    if not dup:
                        self.ids.add(sized.id)
                if dup:  # (the id it would have had belongs to the other task: not released)
                    raise _Rejected("duplicate", "the same code as an accepted task (after calibration)")
                task, row["task_id"] = sized, sized.id
            if cfg.runtime_filter:
                ms = float(res.get("eager_ms", 0.0))
                if not cfg.min_ms <= ms <= cfg.max_ms:
                    raise _Rejected("runtime", f"eager takes {ms:.3f} ms, outside [{cfg.min_ms}, {cfg.max_ms}] ms",
                                    eager_ms=ms)
        except _Rejected as r:
            with self.lock:
                self.ids.discard(task.id)
            reject(r.stage, r.why, code=code, **r.extra)
            return
        out = {"ops": c.ops, "data_source": c.data_source, "code": code, **row,
               "eager_ms": res.get("eager_ms"), "compile_ms": res.get("compile_ms"), "filters": prov,
               **({"device_wait_s": res["device_wait_s"]} if "device_wait_s" in res else {})}
        with self.lock:
            self._write(self.out, out)
            self._count(out)
            self.summary.candidates += 1
        if self.on_update:
            self.on_update(self.summary)

    def run(self) -> Summary:
        """Keep `workers` candidates in flight (never more than are still wanted, so the run
        stops at exactly n) until n are produced, the candidate limit is reached, or the
        time limit has passed (then those in flight finish and nothing new starts)."""
        import time
        from concurrent.futures import FIRST_COMPLETED, Future, wait

        t0 = time.perf_counter()
        cfg = self.cfg
        limit = cfg.max_candidates or 20 * cfg.n
        deadline = t0 + cfg.time_limit_s if cfg.time_limit_s else None
        i = 0
        inflight: set[Future[None]] = set()
        with ThreadPoolExecutor(max(1, cfg.workers), thread_name_prefix="cuda-agent-datagen") as pool:
            while True:
                while (len(inflight) < max(1, cfg.workers) and self.summary.produced + len(inflight) < cfg.n
                       and i < limit and (deadline is None or time.perf_counter() < deadline)):
                    if i not in self.done:
                        inflight.add(pool.submit(self.process, i))
                    i += 1
                if not inflight:
                    break
                finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()
        self.summary.seconds = time.perf_counter() - t0
        self.summary.stopped_by_time = deadline is not None and self.summary.produced < cfg.n and i < limit
        write_parquet(self.out)
        return self.summary


class _Rejected(Exception):
    def __init__(self, stage: str, why: str, **extra: Any) -> None:
        super().__init__(why)
        self.stage, self.why, self.extra = stage, why, extra


def write_parquet(jsonl: Path) -> Path | None:
    """The dataset as parquet beside the JSONL (needs pyarrow; skipped without it)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    if not jsonl.exists():
        return None
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    for r in rows:
        r["ops"] = json.dumps(r["ops"])  # the published schema keeps ops as a string
        r["filters"] = json.dumps(r.get("filters", {}))
    path = jsonl.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
