"""Locked: `bash utils/compile.sh` (build kernels/ into cuda_extension.so)."""

import sys

from cuda_agent.workspace.commands import compile_main

if __name__ == "__main__":
    sys.exit(compile_main())
