"""`cuda-agent rl ...`: each subcommand's arguments and handler live in its own module,
which provides `add_cli(subparsers)`."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = ("data", "rft", "launch", "smoke")


def add_rl_parser(sub: argparse._SubParsersAction) -> None:
    rl = sub.add_parser("rl", help="RL training on verl: data, RFT set, stage recipes, a smoke step")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"cuda_agent.rl.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cuda_agent.rl.{name}":
                raise
            continue  # not written yet
        module.add_cli(rl_sub)
