#!/usr/bin/env bash
# Installs cuda-agent with its test tools and the RL extra (verl). The CPU build of torch is installed first so
# that pip never resolves torch to a multi-GB CUDA build; on a machine that already has
# a CUDA torch in the range, that one is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # Set TORCH_INDEX_URL to PyTorch's CPU wheel index to keep a GPU-less machine small.
  "$PY" -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install --quiet -e ".[test,rl]"
"$PY" -c "import cuda_agent.sandbox as s; ok, why = s.sandbox_available(); print('sandbox:', 'bubblewrap works' if ok else why)"
