#!/usr/bin/env bash
# Launch the stage2_rft recipe (config.yaml beside this file), e.g.
#   recipes/stage2_rft/run.sh --model STAGE1_ACTOR --nodes 1 --gpus-per-node 8 \
#       --data DATA --out OUT --ray-address http://HEAD:8265 [--dry-run] [key=value ...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec cuda-agent rl launch "$here" "$@"
