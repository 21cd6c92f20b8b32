"""`cuda-agent`: the command line. Each subcommand parses its flags and calls one function."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from cuda_agent import __version__


class UsageError(Exception):
    """A user mistake: one clear sentence, exit code 2."""


def _pick_task(path: str, name: str | None):  # type: ignore[no-untyped-def]
    from cuda_agent.tasks import find_task, load_tasks

    p = Path(path)
    if p.is_dir() and (p / "model.py").is_file() and (p / "utils").is_dir():
        from cuda_agent.workspace import load_record

        return load_record(p).task
    tasks = load_tasks(p)
    if name:
        return find_task(tasks, name)
    if len(tasks) != 1:
        raise UsageError(f"{path} holds {len(tasks)} tasks; choose one with --task NAME")
    return tasks[0]


def cmd_eval(args: argparse.Namespace) -> int:
    from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
    from cuda_agent.evaluator.solution import load_solution

    task = _pick_task(args.task, args.task_name)
    solution = load_solution(args.solution)
    opts = EvalOptions(
        device=args.device, atol=args.atol, rtol=args.rtol, seed=args.seed, sandbox=not args.no_sandbox,
        trials=args.trials, distribution_trials=args.distribution_trials, run_timeout_s=args.timeout,
        build_timeout_s=args.build_timeout, gpu_index=args.gpu, arch=args.arch, profile=not args.no_profile, reward_name=args.reward,
        threshold=args.threshold, compile_mode=args.compile_mode, threads=args.threads,
        baseline_cache=not args.fresh_baselines,
    )
    result = evaluate(task, solution, opts)
    if args.json:
        print(result.to_json())
    else:
        print(result.summary())
    return 0


def cmd_workspace(args: argparse.Namespace) -> int:
    from cuda_agent.workspace import create_workspace

    task = _pick_task(args.task, args.task_name)
    ws = create_workspace(task, args.dir, args.device, force=args.force)
    print(f"workspace for {task.name} ({args.device}) at {ws}")
    print("inside it: bash utils/compile.sh; python3 -m utils.verification; python3 -m utils.profiling")
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from cuda_agent.agent import AgentConfig, Progress, make_client, run_episode
    from cuda_agent.evaluator.evaluate import resolve_device

    task = _pick_task(args.task, args.task_name)
    device = resolve_device(args.device)
    model = args.model or os.environ.get("CUDA_AGENT_MODEL")
    if not (model or args.replay):
        raise UsageError(
            "name the model with --model (or $CUDA_AGENT_MODEL), or pass --replay SCRIPT")
    replay_name = f"replay:{Path(args.replay).name}" if args.replay else "replay"
    try:
        client = make_client(model or "", args.base_url, args.api_key, replay=args.replay,
                             replay_name=replay_name, timeout_s=args.request_timeout,
                             temperature=args.temperature)
    except (OSError, ValueError) as exc:
        if not args.replay:
            raise
        raise UsageError(f"cannot read the replay script {args.replay}: {exc}") from exc
    cfg = AgentConfig(max_turns=args.max_turns, context_tokens=args.context_tokens, wall_time_s=args.wall_time,
                      score_every_build=args.score_every_build, sandbox=not args.no_sandbox,
                      gpu_index=args.gpu if device == "cuda" else None)
    out = Path(args.out or f"runs/{task.name}")
    console = Console(stderr=True)

    def view(p: Progress) -> Table:
        t = Table.grid(padding=(0, 2))
        best = f"{p.best_speedup:.3f}x vs torch.compile (reward {p.best_reward:g})" if p.best_speedup else \
            ("correct" if p.best_reward else "none yet")
        t.add_row(f"[bold]{task.name}[/]", f"turn {p.turn}/{cfg.max_turns}", f"last tool: {p.last_tool or '-'}",
                  f"best: {best}", f"tokens: {p.tokens}", f"[dim]{p.status}")
        return t

    progress = Progress()
    with Live(view(progress), console=console, refresh_per_second=4, transient=False) as live:
        progress.on_update = lambda p: live.update(view(p))
        try:
            summary = asyncio.run(run_episode(task, client, out, device=device, config=cfg, resume=args.resume,
                                              progress=progress))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    print(json.dumps(summary.to_dict(), indent=1) if args.json else
          f"{task.name}: {summary.reason} after {summary.turns} turns; reward {summary.reward:g}"
          + (f", {summary.speedup_vs_eager:.3f}x eager, {summary.speedup_vs_compile:.3f}x torch.compile"
             if summary.speedup_vs_compile else "")
          + f"\n  best solution: {out / 'best'}\n  trajectory:    {out / 'trajectory.jsonl'}"
          + f"\n  summary:       {out / 'summary.json'}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from cuda_agent.agent.show import render

    path = Path(args.trajectory)
    if path.is_dir():
        path = path / "trajectory.jsonl"
    if not path.is_file():
        raise UsageError(f"{args.trajectory}: no trajectory there")
    render(path, full=args.full)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from cuda_agent.bench.jobs import AgentSpec, BenchConfig
    from cuda_agent.bench.report import write_report
    from cuda_agent.bench.runner import run_bench
    from cuda_agent.bench.suite import load_suite
    from cuda_agent.evaluator.evaluate import resolve_device
    from cuda_agent.machine import gpu_count

    if bool(args.solutions) == bool(args.agent):
        raise UsageError("give either --solutions DIR or --agent (with --model/--base-url or --replay)")
    entries = load_suite(args.tasks)
    device = resolve_device(args.device)
    agent = None
    if args.agent:
        if not (args.model or args.replay or os.environ.get("CUDA_AGENT_MODEL")):
            raise UsageError("--agent needs --model (or $CUDA_AGENT_MODEL) or --replay SCRIPT")
        agent = AgentSpec(model=args.model or os.environ.get("CUDA_AGENT_MODEL"), base_url=args.base_url,
                          api_key=args.api_key, replay=args.replay, max_turns=args.max_turns,
                          episodes_per_device=args.episodes_per_device)
    solutions = Path(args.solutions) if args.solutions else None
    if solutions is not None and not solutions.is_dir():
        raise UsageError(f"--solutions {solutions} is not a folder")
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(max(1, args.workers or gpu_count())))
    cfg = BenchConfig(device=device, gpus=gpus, workers=args.workers or 1, agent=agent, ray_address=args.ray,
                      service_url=args.service,
                      eval_options={"sandbox": not args.no_sandbox, "profile": not args.no_profile,
                                    "trials": args.trials, "distribution_trials": args.distribution_trials,
                                    "run_timeout_s": args.timeout,
                                    "threshold": args.threshold})
    out = Path(args.out or "bench-out")
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console) as bar:
        tid = bar.add_task("bench", total=len(entries), last="")

        def planned(todo: int, skipped: int) -> None:
            bar.update(tid, completed=skipped, description=f"bench ({skipped} done before)" if skipped else "bench")

        def done(rec: Any) -> None:
            sp = f" {rec.speedup_vs_compile:.2f}x" if rec.speedup_vs_compile else ""
            bar.update(tid, advance=1, last=f"{rec.task_name}: {rec.status}{sp}")

        try:
            records = run_bench(entries, out, solutions=solutions, cfg=cfg, resume=args.resume, on_record=done,
                                on_plan=planned)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    md, page = write_report(out, threshold=args.threshold)
    from cuda_agent.bench.metrics import metrics

    m = metrics(records, args.threshold)
    print(f"{m['tasks']} tasks: pass {100 * m.get('pass_rate', 0):.1f}%, faster than eager "
          f"{100 * m.get('faster_than_eager', 0):.1f}%, than torch.compile {100 * m.get('faster_than_compile', 0):.1f}%, "
          f"geomean {m.get('geomean_vs_compile') or '-'}x vs torch.compile\n  results: {out / 'results.jsonl'}\n"
          f"  report:  {md}, {page}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import write_report

    try:
        md, page = write_report(Path(args.results), Path(args.out) if args.out else None, threshold=args.threshold)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {md} and {page}")
    return 0


def cmd_datagen(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from cuda_agent.datagen.compose import PUBLISHED_MIX, normalised_mix
    from cuda_agent.datagen.pipeline import DatagenConfig, Generator, Summary
    from cuda_agent.evaluator.evaluate import resolve_device

    mix: dict[int | str, float] = dict(PUBLISHED_MIX)
    if args.mix:
        try:
            mix = {(k if k == "transformers" else int(k)): float(v)
                   for k, v in (part.split("=") for part in args.mix.split(","))}
        except ValueError as exc:
            raise UsageError(f"--mix takes e.g. 1=0.1,2=0.8,3=0.1 ({exc})") from exc
    llm = None
    if args.composer == "llm":
        from cuda_agent.agent import make_client

        model = args.model or os.environ.get("CUDA_AGENT_MODEL")
        if not model:
            raise UsageError("--composer llm needs --model (or $CUDA_AGENT_MODEL)")
        llm = make_client(model, args.base_url, args.api_key)
    device = resolve_device(args.device)
    cfg = DatagenConfig(n=args.n, seed=args.seed, composer=args.composer, mix=mix, device=device, gpu_index=args.gpu,
                        min_ms=args.min_ms, max_ms=args.max_ms, runtime_filter=not args.no_runtime_filter,
                        calibrate=not args.no_calibrate, max_input_mb=args.max_input_mb,
                        compile_filter=not args.no_compile_filter,
                        decontaminate=Path(args.decontaminate) if args.decontaminate else None,
                        threshold=args.threshold, workers=args.workers, scale=args.scale,
                        sandbox=not args.no_sandbox, llm=llm, time_limit_s=args.time_limit)
    out = Path(args.out)
    console = Console(stderr=True)

    def line(s: Summary) -> str:
        rej = ", ".join(f"{k} {v}" for k, v in s.rejected.most_common()) or "none"
        return f"datagen: {s.produced}/{cfg.n} produced from {s.candidates} candidates; rejected: {rej}"

    with Live(line(Summary()), console=console, refresh_per_second=4) as live:
        try:
            gen = Generator(cfg, out, resume=args.resume, on_update=lambda s: live.update(line(s)))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        s = gen.run()
    target = normalised_mix(mix)
    t = Table(title=f"{s.produced} tasks in {out} ({s.candidates} candidates, {s.seconds:.0f} s, "
                    f"yield {100 * s.produced / max(1, s.candidates):.1f}%)")
    t.add_column("operators")
    t.add_column("produced", justify="right")
    t.add_column("share", justify="right")
    t.add_column("target", justify="right")
    for k in sorted(target, key=str):
        n = s.n_ops.get(str(k), 0)
        t.add_row(str(k), str(n), f"{100 * n / max(1, s.produced):.1f}%", f"{100 * target[k]:.1f}%")
    r = Table(title="rejected per filter")
    r.add_column("filter")
    r.add_column("rejected", justify="right")
    for k, v in s.rejected.most_common():
        r.add_row(k, str(v))
    o = Table(title="most frequent operators")
    o.add_column("operator")
    o.add_column("tasks", justify="right")
    for k, v in s.ops.most_common(15):
        o.add_row(k, str(v))
    out_console = Console()
    for table in (t, r, o):
        out_console.print(table)
    if s.stopped_by_time:
        out_console.print(f"stopped at the time limit ({args.time_limit:g} s) with {s.produced} of {cfg.n}: "
                          "run again with --resume to continue")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cuda-agent", description="Write, verify and reward custom kernels.")
    ap.add_argument("--version", action="version", version=f"cuda-agent {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("eval", help="evaluate one solution for one task")
    ev.add_argument("task", help="task file (KernelBench format), a folder/JSONL/parquet with --task, or a workspace")
    ev.add_argument("solution", help="workspace directory (model_new.py + kernels/) or a single model_new.py")
    ev.add_argument("--task", dest="task_name", help="task name or id when TASK holds several")
    ev.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument("--atol", type=float, default=1e-2)
    ev.add_argument("--rtol", type=float, default=1e-2)
    ev.add_argument("--seed", type=int, default=None, help="fix the trial seeds (default: random, recorded)")
    ev.add_argument("--trials", type=int, default=5, help="trials of the task's own get_inputs()")
    ev.add_argument("--distribution-trials", type=int, default=3,
                    help="trials besides on other input distributions (scaled, normal, heavy-tailed)")
    ev.add_argument("--timeout", type=float, default=300.0, help="seconds for the candidate process")
    ev.add_argument("--build-timeout", type=float, default=600.0)
    ev.add_argument("--gpu", type=int, default=0, help="GPU index to evaluate on")
    ev.add_argument("--arch", default=None, help="CUDA compute capability, e.g. 9.0 (default: detected)")
    ev.add_argument("--no-sandbox", action="store_true", help="run without bubblewrap (unsafe)")
    ev.add_argument("--no-profile", action="store_true", help="check correctness only (reward 1 when correct)")
    ev.add_argument("--reward", choices=["milestone", "speedup"], default="milestone")
    ev.add_argument("--threshold", type=float, default=0.05, help="how much faster counts as faster (fraction)")
    ev.add_argument("--compile-mode", default="default",
                    help="torch.compile mode of the baseline: default, reduce-overhead, max-autotune, ...")
    ev.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads when timing (default: all)")
    ev.add_argument("--fresh-baselines", action="store_true",
                    help="measure eager and torch.compile anew instead of using the baseline cache")
    ev.set_defaults(func=cmd_eval)

    op = sub.add_parser("optimize", help="run the agent on a task: write, compile, verify, profile, improve")
    op.add_argument("task", help="task file, folder/JSONL/parquet (with --task), or a workspace")
    op.add_argument("--task", dest="task_name", help="task name or id when TASK holds several")
    op.add_argument("--model", help="model name on the server (default $CUDA_AGENT_MODEL)")
    op.add_argument("--base-url", help="OpenAI-compatible API base URL (default $OPENAI_BASE_URL)")
    op.add_argument("--api-key", help="API key (default $OPENAI_API_KEY)")
    op.add_argument("--replay", help="play back a script or a recorded trajectory instead of calling a model")
    op.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    op.add_argument("--gpu", type=int, default=0)
    op.add_argument("--max-turns", type=int, default=200)
    op.add_argument("--context-tokens", type=int, default=131_072)
    op.add_argument("--wall-time", type=float, default=4 * 3600.0, help="seconds for the episode")
    op.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one model request")
    op.add_argument("--temperature", type=float, default=None)
    op.add_argument("--score-every-build", action="store_true", help="profile every state that compiled")
    op.add_argument("--out", help="output directory (default runs/TASK_NAME)")
    op.add_argument("--resume", action="store_true", help="continue the episode in --out")
    op.add_argument("--no-sandbox", action="store_true", help="run the tools without bubblewrap (unsafe)")
    op.add_argument("--json", action="store_true", help="print the summary as JSON")
    op.set_defaults(func=cmd_optimize)

    be = sub.add_parser("bench", help="evaluate solutions, or run the agent, over a task suite; then report")
    be.add_argument("tasks", help="folder of task files (e.g. KernelBench's level1..3), JSONL/parquet, or one file")
    be.add_argument("--solutions", help="folder of solutions, matched to tasks by name")
    be.add_argument("--agent", action="store_true", help="run the agent per task instead")
    be.add_argument("--model")
    be.add_argument("--base-url")
    be.add_argument("--api-key")
    be.add_argument("--replay", help="with --agent: a script played back instead of a model")
    be.add_argument("--max-turns", type=int, default=200)
    be.add_argument("--episodes-per-device", type=int, default=1, help="with --agent: concurrent episodes per GPU")
    be.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    be.add_argument("--gpus", help="GPU indices to use, e.g. 0,1,2,3 (default: all visible)")
    be.add_argument("--workers", type=int, default=None, help="CPU backend: workers sharing the cores; CUDA: GPUs")
    be.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster ('auto', 'local' or an address)")
    be.add_argument("--service", metavar="URL",
                    help="send the solutions to a running `cuda-agent serve` (http://HOST:PORT or unix:///PATH); "
                         "default: one started for the run")
    be.add_argument("--out", help="output folder (default bench-out)")
    be.add_argument("--resume", action="store_true", help="skip tasks already in --out/results.jsonl")
    be.add_argument("--no-profile", action="store_true")
    be.add_argument("--trials", type=int, default=5, help="trials of the task's own get_inputs()")
    be.add_argument("--distribution-trials", type=int, default=3,
                    help="trials besides on other input distributions (scaled, normal, heavy-tailed)")
    be.add_argument("--timeout", type=float, default=300.0)
    be.add_argument("--threshold", type=float, default=0.05)
    be.add_argument("--no-sandbox", action="store_true")
    be.set_defaults(func=cmd_bench)

    rp = sub.add_parser("report", help="write the Markdown/HTML report of a bench run")
    rp.add_argument("results", help="results.jsonl or the bench --out folder")
    rp.add_argument("--out", help="folder for the report (default: beside the results)")
    rp.add_argument("--threshold", type=float, default=0.05)
    rp.set_defaults(func=cmd_report)

    dg = sub.add_parser("datagen", help="synthesize and filter training tasks (CUDA-Agent-Ops-6K style)")
    dg.add_argument("--n", type=int, required=True, help="tasks to produce")
    dg.add_argument("--out", required=True, help="output .jsonl (a .parquet and a .rejects.jsonl go beside it)")
    dg.add_argument("--composer", choices=["offline", "llm"], default="offline")
    dg.add_argument("--model")
    dg.add_argument("--base-url")
    dg.add_argument("--api-key")
    dg.add_argument("--mix", help="share of tasks per operator count, e.g. 1=0.034,2=0.838,3=0.076,4=0.028,5=0.012")
    dg.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    dg.add_argument("--gpu", type=int, default=0)
    dg.add_argument("--decontaminate", metavar="DIR", help="benchmark folder (e.g. KernelBench) to stay away from")
    dg.add_argument("--threshold", type=float, default=0.9, help="AST similarity above which a task is a copy")
    dg.add_argument("--min-ms", type=float, default=1.0)
    dg.add_argument("--max-ms", type=float, default=100.0)
    dg.add_argument("--no-runtime-filter", action="store_true")
    dg.add_argument("--no-calibrate", action="store_true",
                    help="reject tasks outside the runtime range instead of scaling their batch size into it")
    dg.add_argument("--max-input-mb", type=float, default=2048.0,
                    help="calibration never makes a task's inputs larger than this")
    dg.add_argument("--no-compile-filter", action="store_true")
    dg.add_argument("--scale", type=float, default=1.0, help="input sizes times this (e.g. 0.1 for CPU runs)")
    dg.add_argument("--workers", type=int, default=1)
    dg.add_argument("--seed", type=int, default=0)
    dg.add_argument("--resume", action="store_true")
    dg.add_argument("--time-limit", type=float, metavar="S",
                    help="start no new candidate after S seconds; those in flight finish (continue with --resume)")
    dg.add_argument("--no-sandbox", action="store_true")
    dg.set_defaults(func=cmd_datagen)

    sh = sub.add_parser("show", help="render a trajectory (or an --out directory) in the terminal")
    sh.add_argument("trajectory")
    sh.add_argument("--full", action="store_true", help="do not shorten long messages")
    sh.set_defaults(func=cmd_show)

    ws = sub.add_parser("workspace", help="create an agent workspace for a task")
    ws.add_argument("task")
    ws.add_argument("dir")
    ws.add_argument("--task", dest="task_name")
    ws.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ws.add_argument("--force", action="store_true", help="refresh the locked files of an existing workspace")
    ws.set_defaults(func=cmd_workspace)

    from cuda_agent.rl.cli import add_rl_parser
    from cuda_agent.serve.cli import add_cli as add_serve_parser

    add_serve_parser(sub)
    add_rl_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    from cuda_agent.evaluator.solution import SolutionError
    from cuda_agent.sandbox import SandboxUnavailable
    from cuda_agent.tasks import TaskError
    from cuda_agent.workspace import WorkspaceError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UsageError, TaskError, SolutionError, SandboxUnavailable, WorkspaceError, ValueError) as exc:
        print(f"cuda-agent: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

