"""Locked: `python3 -m utils.profiling` (timing against eager PyTorch and torch.compile)."""

import sys

from cuda_agent.workspace.commands import profiling_main

if __name__ == "__main__":
    sys.exit(profiling_main())
