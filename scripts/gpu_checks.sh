#!/usr/bin/env bash
# GPU tests and build benchmark on a CUDA machine; logs go to ${OUT:-./gpu-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-./gpu-out}; mkdir -p "$OUTDIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/cuda-agent-cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
python3 -m pytest tests/gpu -m gpu -v -s -p no:cacheprovider 2>&1 | tee "$OUTDIR/gpu_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/build_times.py --device cuda --repeats 3 2>&1 | tee "$OUTDIR/build_bench.log"
fi
