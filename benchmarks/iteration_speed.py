"""Wall time of one agent iteration (edit one kernel file, compile, verify, profile) with
cuda-agent, cold and warm, beside the released agent_workdir's flow on the same solution.

    python benchmarks/iteration_speed.py [--device cuda|cpu] [--repeats 3]

cuda-agent: `bash utils/compile.sh` then `python3 -m utils.profiling` (which verifies first)
in a workspace; cold = empty cache directory (build, precompiled header, torch.compile
baselines all new), warm = after a one-line edit of the kernel file. Each command first
runs on its own (a new evaluator process per command, as a user's shell without the
agent has it), then through the evaluation service as in an agent episode: the shell's
commands go to one long-lived evaluator, whose evaluations take the reference and
candidate processes started ahead by the one before (`evaluator.warm`). That is timed
back to back (edit, compile, profile at once: the compile runs while the spare
starts) and after a pause that lets the spare finish starting before the edit, as the
agent's reading of the profile and writing of its next kernel does. Each build prints its
own seconds and ninja's steps. A `cuda-agent eval
--json` of the edited workspace prints where the time goes.

Released flow, as its scripts do it, each step a new process: force rebuild (build dir
deleted, `torch.utils.cpp_extension.load` of every source), verification (reference and
new model on fresh inputs, compared), profiling (5 warm-up and 10 profiled calls of the
model, of `torch.compile(model)` compiled anew, and of the new model, device time summed
from torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "src" / "cuda_agent" / "workspace" / "templates"


def timed(cmd: list[str], cwd: Path, env: dict[str, str], label: str = "") -> tuple[float, str]:
    """Run one step; its time is printed at once, so a run cut short still reports."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    print(f"  {dt:8.2f} s  {label or ' '.join(cmd[-2:])}", flush=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return dt, p.stdout


RELEASED_BUILD = """
import shutil, sys
from pathlib import Path
import torch.utils.cpp_extension as ce
root = Path(sys.argv[1]); cuda = sys.argv[2] == "cuda"
build = root / "build" / "forced_compile"
shutil.rmtree(build, ignore_errors=True); build.mkdir(parents=True)
srcs = sorted(str(p) for p in [*root.glob("*.cpp"), *(root / "kernels").glob("*.cu"), *(root / "kernels").glob("*.cpp")])
ce.load(name="cuda_extension", sources=srcs, build_directory=str(build), verbose=False, with_cuda=cuda,
        extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math"])
"""

# Written for this benchmark: the same steps as the released scripts, not their code.
RELEASED_VERIFY = """
import sys
from pathlib import Path
root = Path(sys.argv[1]); dev = sys.argv[2]
sys.path[:0] = [str(root), str(root / "build" / "forced_compile")]
import torch
import cuda_extension  # noqa: F401
import model, model_new
init = model.get_init_inputs()
torch.manual_seed(0); ref = model.Model(*init).to(dev).eval()
torch.manual_seed(0); new = model_new.ModelNew(*init).to(dev).eval()
new.load_state_dict(ref.state_dict())
with torch.no_grad():
    for k in range(5):
        torch.manual_seed(100 + k)
        xs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in model.get_inputs()]
        assert torch.allclose(ref(*xs), new(*xs), atol=1e-2, rtol=1e-2), k
print("verify success")
"""

RELEASED_PROFILE = """
import sys
from pathlib import Path
root = Path(sys.argv[1]); dev = sys.argv[2]
sys.path[:0] = [str(root), str(root / "build" / "forced_compile")]
import torch
from torch.profiler import ProfilerActivity, profile
import cuda_extension  # noqa: F401
import model, model_new
init = model.get_init_inputs()
torch.manual_seed(0); ref = model.Model(*init).to(dev).eval()
new = model_new.ModelNew(*init).to(dev).eval(); new.load_state_dict(ref.state_dict())
compiled = torch.compile(ref)
xs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in model.get_inputs()]
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
def device_us(m):
    with torch.no_grad():
        for _ in range(5):
            m(*xs)
        if dev == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as p:
            for _ in range(10):
                m(*xs)
            if dev == "cuda":
                torch.cuda.synchronize()
    evs = p.key_averages()
    attr = "self_device_time_total" if dev == "cuda" else "self_cpu_time_total"
    return sum(getattr(e, attr, 0.0) for e in evs) / 10
for name, m in (("eager", ref), ("compile", compiled), ("candidate", new)):
    print(name, round(device_us(m), 2))
"""


class StackSampler:
    """Where this process's threads are during a step, by sampling: every `every_s`, each
    thread's innermost frame in cuda_agent's code, keyed by the thread's outermost cuda_agent
    function (the evaluation's `_run`, a reference's or candidate's `go`, a spare's start).
    What `evaluator_phases_s` leaves coarse (a wait of seconds between two marks) shows here
    as the line it waited on."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.counts: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner = outer = None
                f = frame
                while f is not None:
                    if f"{os.sep}cuda_agent{os.sep}" in f.f_code.co_filename:
                        inner, outer = inner or f, f
                    f = f.f_back
                if inner is None or outer is None:
                    continue
                if outer.f_code.co_name == "_serve":  # the service's accept loop: always there
                    continue
                key = (outer.f_code.co_name,
                       f"{Path(inner.f_code.co_filename).name}:{inner.f_lineno} {inner.f_code.co_name}")
                self.counts[key] = self.counts.get(key, 0) + 1

    def report(self, top: int = 12) -> str:
        rows = sorted(self.counts.items(), key=lambda kv: -kv[1])[:top]
        return "\n".join(f"      {n * self.every_s:6.2f} s  {who:24s} at {where}" for (who, where), n in rows)


def new_task_workspace(task: Path, sol: Path, tmp: Path, env: dict[str, str], py: str, device: str) -> Path:
    """A workspace for a task not seen yet (the benchmark's task, other sizes): nothing of it
    is cached, while the machine's caches (precompiled header, processes) are warm."""
    text = task.read_text()
    variant = tmp / f"{task.stem}_new.py"
    variant.write_text(text.replace("rows = 256", "rows = 384") if "rows = 256" in text else text + "\n# new task\n")
    ws = tmp / "ws-new"
    subprocess.run([py, "-m", "cuda_agent.cli", "workspace", str(variant), str(ws), "--device", device],
                   check=True, env=env, capture_output=True)
    return ws


def put_solution(ws: Path, sol: Path) -> None:
    """The agent writes its kernels (never built before: each file gets a new line)."""
    shutil.copy(sol / "model_new.py", ws / "model_new.py")
    for f in (sol / "kernels").iterdir():
        if f.suffix in (".cu", ".cpp", ".h", ".cuh"):
            (ws / "kernels" / f.name).write_text(f.read_text() + f"\n// new solution {time.time_ns()}\n")
        else:
            shutil.copy(f, ws / "kernels" / f.name)


def print_build(res: object) -> None:
    """The build's own seconds and its steps (from ninja's log), beside compile.sh's."""
    if res is None or not hasattr(res, "rebuilt"):
        return
    steps = {}
    log = Path(res.build_dir or "") / "obj" / ".ninja_log"
    if res.rebuilt and log.exists():
        for line in log.read_text().splitlines()[-len(res.rebuilt):]:
            start, end, _, out, *_ = line.split("\t")
            steps[out] = round((int(end) - int(start)) / 1e3, 3)
    print(f"    build: {res.duration_s:.3f} s, steps (s): {steps}", flush=True)


def service_rows(ws: Path, env: dict[str, str], kernel: Path, repeats: int, py: str, task: Path, sol: Path,
                 tmp: Path, device: str) -> list[tuple[str, list[float]]]:
    """compile + profiling through the evaluation service, back to back and with the spare
    ready; then a new task's first evaluation, through a new episode's service."""
    from cuda_agent.agent.service import EvalService
    from cuda_agent.evaluator import warm
    from cuda_agent.workspace.commands import SOCKET_ENV

    os.environ["CUDA_AGENT_CACHE"] = env["CUDA_AGENT_CACHE"]  # the service's evaluator: same caches
    results: list = []
    control = Path(tempfile.mkdtemp(prefix="control-"))
    service = EvalService(ws, control, listener=lambda name, argv, rc, text, res: results.append(res))
    service.start()
    s_env = dict(env, **{SOCKET_ENV: str(service.path), "CUDA_AGENT_WORKSPACE": str(ws)})
    rows: list[tuple[str, list[float]]] = []

    def prefetch_row(svc: EvalService, label: str) -> None:
        # what the service does at its start, while the agent reads the task (its first turns)
        svc.wait_prefetched(900)
        pre = svc.prefetched or {}
        print(f"  {pre.get('seconds', 0.0):8.2f} s  {label}: prefetch at the service's start {pre}", flush=True)
        rows.append((f"{label}: prefetch at start (baselines, precompiled headers; overlaps the agent's reading)",
                     [float(pre.get("seconds", 0.0))]))

    try:
        prefetch_row(service, "service")
        timed(["bash", "utils/compile.sh"], ws, s_env, "service: compile.sh")
        timed([py, "-m", "utils.profiling"], ws, s_env, "service: first profiling (no spare yet)")
        for label, pause in (("back to back", False), ("spare ready (as after the agent's thinking)", True)):
            comp, prof = [], []
            for i in range(repeats):
                if pause:
                    # The agent reads the profile and writes its next kernel before it compiles
                    # again: the spares started after the last evaluation warm up meanwhile.
                    t_w = time.perf_counter()
                    ok = warm.POOL.wait_all_ready(120)  # the candidate's, the reference's, the baseline's
                    print(f"  (spares ready: {ok}, waited {time.perf_counter() - t_w:.2f} s)", flush=True)
                kernel.write_text(kernel.read_text() + f"\n// service edit {label[:4]} {i} {time.time_ns()}\n")
                comp.append(timed(["bash", "utils/compile.sh"], ws, s_env, "service: compile.sh")[0])
                print_build(results[-1])
                with StackSampler() as sampler:
                    prof.append(timed([py, "-m", "utils.profiling"], ws, s_env, f"service: profiling, {label}")[0])
                print("    where the service's threads were (sampled):\n" + sampler.report(), flush=True)
                rec = results[-1]
                if rec is not None and hasattr(rec, "timings_s"):
                    print("    timings_s:", rec.timings_s, "warm_start:", rec.details.get("warm_start"),
                          "flags:", rec.flags, flush=True)
                    print("    evaluator, when each step ended (s):", rec.details.get("evaluator_phases_s"), flush=True)
                    print("    candidate phases:", rec.details.get("candidate_phases_s"), flush=True)
                    print("    candidate timing:", rec.details.get("candidate_measure_s"),
                          {k: (v or {}).get("iterations") for k, v in (rec.times_us or {}).items()}, flush=True)
            rows += [(f"service, {label}: compile.sh", comp), (f"service, {label}: profiling", prof),
                     (f"service, {label}: iteration = compile + profiling",
                      [a + b for a, b in zip(comp, prof, strict=True)])]
        # A new task in the same long-lived evaluator (the next episode): the new service
        # prefetches its baselines (torch.compile included); then the agent's kernels are
        # written, built anew and profiled, with the spares ready.
        ws2 = new_task_workspace(task, sol, tmp, env, py, device)
        service.close()
        service = EvalService(ws2, control, listener=lambda name, argv, rc, text, res: results.append(res))
        service.start()
        n_env = dict(env, **{SOCKET_ENV: str(service.path), "CUDA_AGENT_WORKSPACE": str(ws2)})
        prefetch_row(service, "service, new task")
        print(f"  (spares ready: {warm.POOL.wait_all_ready(120)})", flush=True)
        put_solution(ws2, sol)
        c2 = timed(["bash", "utils/compile.sh"], ws2, n_env, "service: new task, compile.sh (its first build)")[0]
        print_build(results[-1])
        p2 = timed([py, "-m", "utils.profiling"], ws2, n_env, "service: new task, first profiling")[0]
        rec = results[-1]
        if rec is not None and hasattr(rec, "timings_s"):
            print("    timings_s:", rec.timings_s, "warm_start:", rec.details.get("warm_start"), flush=True)
        rows += [("service, new task: compile.sh (its kernels, after the prefetch)", [c2]),
                 ("service, new task: first profiling (baselines prefetched)", [p2]),
                 ("service, new task: first evaluation = compile + profiling", [c2 + p2])]
    finally:
        service.close()
        warm.POOL.close()
        shutil.rmtree(control, ignore_errors=True)
    return rows


def print_rows(rows: list[tuple[str, list[float]]], device: str, task: Path) -> None:
    print(f"\nper-iteration wall time, {device}, task {task.stem}, {os.cpu_count()} cores (seconds)")
    print(f"{'step':58s} {'median':>8s} {'min':>8s} {'max':>8s}  n")
    for name, xs in rows:
        print(f"{name:58s} {statistics.median(xs):8.2f} {min(xs):8.2f} {max(xs):8.2f}  {len(xs)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--task", type=Path, default=REPO / "examples" / "tasks" / "axpby.py")
    ap.add_argument("--solution", type=Path, default=None)
    ap.add_argument("--service-only", action="store_true",
                    help="only the evaluation service's rows (the agent's case), not the commands run "
                         "on their own nor the released flow")
    args = ap.parse_args()
    sol = args.solution or REPO / "examples" / "solutions" / f"axpby_{args.device}"
    tmp = Path(tempfile.mkdtemp(prefix="iteration-bench-"))
    env = dict(os.environ, CUDA_AGENT_CACHE=str(tmp / "cache"), PYTHONUNBUFFERED="1")
    py = sys.executable
    ws = tmp / "ws"
    subprocess.run([py, "-m", "cuda_agent.cli", "workspace", str(args.task), str(ws), "--device", args.device],
                   check=True, env=env, capture_output=True)
    shutil.copy(sol / "model_new.py", ws / "model_new.py")
    for f in (sol / "kernels").iterdir():
        shutil.copy(f, ws / "kernels" / f.name)
    kernel = next(p for p in sorted((ws / "kernels").iterdir()) if p.suffix in (".cu", ".cpp") and "binding" not in p.name)

    from cuda_agent.evaluator.toolchain import toolchain

    fast = [f for f in toolchain(args.device).ldflags if f.startswith("-fuse-ld=")]
    print(f"linker: {' '.join(fast) or 'GNU ld (the default)'}", flush=True)
    rows: list[tuple[str, list[float]]] = []
    if args.service_only:
        rows += service_rows(ws, env, kernel, args.repeats, py, args.task, sol, tmp, args.device)
        print_rows(rows, args.device, args.task)
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    c, _ = timed(["bash", "utils/compile.sh"], ws, env, "cold compile.sh")
    v, _ = timed([py, "-m", "utils.verification"], ws, env, "cold verification")
    p, out = timed([py, "-m", "utils.profiling"], ws, env, "cold profiling")
    rows += [("cuda-agent cold: compile.sh", [c]), ("cuda-agent cold: verification", [v]),
             ("cuda-agent cold: profiling (verifies, measures baselines)", [p]),
             ("cuda-agent cold: iteration total", [c + v + p])]
    print(out)
    warm_c, warm_p, warm_v = [], [], []
    for i in range(args.repeats):
        kernel.write_text(kernel.read_text() + f"\n// edit {i} {time.time_ns()}\n")
        warm_c.append(timed(["bash", "utils/compile.sh"], ws, env, "warm compile.sh")[0])
        warm_p.append(timed([py, "-m", "utils.profiling"], ws, env, "warm profiling")[0])
        warm_v.append(timed([py, "-m", "utils.verification"], ws, env, "warm verification")[0])
    rows += [("cuda-agent warm: compile.sh after a one-file edit", warm_c),
             ("cuda-agent warm: profiling (verifies too)", warm_p),
             ("cuda-agent warm: iteration = compile + profiling", [a + b for a, b in zip(warm_c, warm_p, strict=True)]),
             ("cuda-agent warm: verification alone", warm_v)]
    _, js = timed([py, "-m", "cuda_agent.cli", "eval", str(ws), str(ws), "--json", "--device", args.device], ws, env)
    rec = json.loads(js)
    print("where a warm evaluation spends its time (s):", rec.get("timings_s"))
    print("candidate process, when each phase began (s):", (rec.get("details") or {}).get("candidate_phases_s"))
    print("candidate timing, where it went (s):", (rec.get("details") or {}).get("candidate_measure_s"))

    rows += service_rows(ws, env, kernel, args.repeats, py, args.task, sol, tmp, args.device)

    rel = tmp / "released"
    shutil.copytree(ws, rel, ignore=shutil.ignore_patterns("cuda_extension.so", "__pycache__"))
    shutil.copy(TEMPLATES / "binding.cpp", rel / "binding.cpp")
    shutil.copy(TEMPLATES / "binding_registry.h", rel / "binding_registry.h")
    scripts = {}
    for name, text in (("build", RELEASED_BUILD), ("verify", RELEASED_VERIFY), ("profile", RELEASED_PROFILE)):
        scripts[name] = tmp / f"released_{name}.py"
        scripts[name].write_text(textwrap.dedent(text))
    r_env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-released"))
    rb, rv, rp = [], [], []
    for i in range(args.repeats):
        k = rel / "kernels" / kernel.name
        k.write_text(k.read_text() + f"\n// edit {i}\n")
        rb.append(timed([py, str(scripts["build"]), str(rel), args.device], rel, r_env, "released force rebuild")[0])
        rv.append(timed([py, str(scripts["verify"]), str(rel), args.device], rel, r_env, "released verification")[0])
        t, out = timed([py, str(scripts["profile"]), str(rel), args.device], rel, r_env, "released profiling")
        rp.append(t)
    print("released-style profile printed:", out.strip().replace("\n", "; "))
    rows += [("released: force rebuild", rb), ("released: verification", rv),
             ("released: profiling (torch.compile anew)", rp),
             ("released: iteration total", [a + b + c for a, b, c in zip(rb, rv, rp, strict=True)])]

    print_rows(rows, args.device, args.task)
    ours = statistics.median([a + b for a, b in zip(warm_c, warm_p, strict=True)])
    theirs = statistics.median([a + b + c for a, b, c in zip(rb, rv, rp, strict=True)])
    print(f"warm iteration: cuda-agent {ours:.2f} s, released flow {theirs:.2f} s: {theirs / ours:.1f}x faster")
    for name, xs in rows:
        if name.startswith("service") and name.endswith("iteration = compile + profiling"):
            m = statistics.median(xs)
            print(f"{name}: {m:.2f} s, released flow {theirs:.2f} s: {theirs / m:.1f}x faster")
    print(f"cold first evaluation: {c + v + p:.2f} s (compile + verification + profiling; empty caches, "
          "the precompiled header included)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
