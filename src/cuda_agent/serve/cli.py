"""`cuda-agent serve`: the evaluation service, until interrupted (then drained)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def add_cli(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="a long-lived evaluation service (HTTP/JSON) that keeps every GPU busy")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8765, help="TCP port (0: any free one; -1: none, --unix only)")
    sv.add_argument("--unix", metavar="PATH", help="also listen on this Unix socket")
    sv.add_argument("--token", help="required of every client (default: $CUDA_AGENT_SERVICE_TOKEN); "
                                    "needed to listen on anything but loopback")
    sv.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    sv.add_argument("--gpus", help="GPU indices, one worker each, e.g. 0,1,2,3 (default: all visible)")
    sv.add_argument("--workers", type=int, default=1, help="CPU backend: workers sharing the cores")
    sv.add_argument("--build-workers", type=int, default=None,
                    help="builds ahead of the workers (default: half the cores on CUDA; 0 on the CPU backend)")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting before new ones get HTTP 429")
    sv.add_argument("--deadline", type=float, default=3600.0, help="a request's deadline unless it sets one (s)")
    sv.add_argument("--grace", type=float, default=600.0, help="on shutdown, how long accepted requests may finish (s)")
    sv.add_argument("--prefetch", metavar="TASKS", action="append", default=[],
                    help="measure these tasks' baselines before serving (file, folder or dataset; repeatable)")
    sv.add_argument("--timeout", type=float, default=300.0, help="each evaluation's run timeout (s)")
    sv.add_argument("--log-dir", help="workers' logs (default: none kept)")
    sv.add_argument("--quiet", action="store_true", help="no progress line")
    sv.add_argument("--no-sandbox", action="store_true", help="trusted solutions only: evaluate unsandboxed")
    sv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from cuda_agent.evaluator.options import resolve_device
    from cuda_agent.machine import gpu_count
    from cuda_agent.serve.client import TOKEN_ENV
    from cuda_agent.serve.engine import Engine, ServiceConfig
    from cuda_agent.serve.http import Server
    from cuda_agent.tasks import load_tasks

    device = resolve_device(args.device)
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(gpu_count()))
    token = args.token or os.environ.get(TOKEN_ENV) or None
    cfg = ServiceConfig(device=device, gpus=gpus, workers=args.workers, build_workers=args.build_workers,
                        max_queue=args.max_queue, default_deadline_s=args.deadline, grace_s=args.grace,
                        sandbox=not args.no_sandbox, eval_options={"run_timeout_s": args.timeout},
                        log_dir=Path(args.log_dir) if args.log_dir else None)
    tasks = [t for spec in args.prefetch for t in load_tasks(spec)]
    say = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    engine = Engine(cfg)
    server = Server(engine, host=args.host, port=None if args.port < 0 else args.port,
                    unix=Path(args.unix) if args.unix else None, token=token)
    engine.start()
    if tasks:
        done = engine.prefetch(tasks, progress=say)
        say(f"prefetched {len(done)} tasks' baselines: "
            + ", ".join(f"{v} {sum(1 for x in done.values() if x == v)}" for v in sorted(set(done.values()))))
    server.start()
    where = " and ".join(x for x in (server.url, f"unix://{args.unix}" if args.unix else None) if x)
    print(f"cuda-agent serve: {device}, workers {', '.join(s.name for s in engine.slots)}, "
          f"{engine.build_workers} build workers, listening on {where}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(10.0):
        say(engine.progress_line())
    say(f"draining (up to {cfg.grace_s:g} s) ...")
    server.close()
    say(engine.progress_line())
    return 0
