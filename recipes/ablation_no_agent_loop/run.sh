#!/usr/bin/env bash
# Launch the ablation_no_agent_loop recipe (config.yaml beside this file), e.g.
#   recipes/ablation_no_agent_loop/run.sh --model RFT_ACTOR --nodes 4 --gpus-per-node 8 --eval-gpus 16 \
#       --data DATA --out OUT --ray-address http://HEAD:8265 [--dry-run] [key=value ...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec cuda-agent rl launch "$here" "$@"
