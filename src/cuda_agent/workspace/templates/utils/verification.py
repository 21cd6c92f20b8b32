"""Locked: `python3 -m utils.verification` (correctness against model.py, 5 random trials)."""

import sys

from cuda_agent.workspace.commands import verification_main

if __name__ == "__main__":
    sys.exit(verification_main())
