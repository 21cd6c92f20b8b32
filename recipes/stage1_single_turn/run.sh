#!/usr/bin/env bash
# Launch the stage1_single_turn recipe (config.yaml beside this file), e.g.
#   recipes/stage1_single_turn/run.sh --model BASE_MODEL --nodes 4 --gpus-per-node 8 --eval-gpus 16 \
#       --data DATA --out OUT --ray-address http://HEAD:8265 [--dry-run] [key=value ...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec cuda-agent rl launch "$here" "$@"
