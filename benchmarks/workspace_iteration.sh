#!/usr/bin/env bash
# One agent iteration in a workspace: compile after a one-file edit, then verification.
# Usage: bash benchmarks/workspace_iteration.sh [cuda|cpu]
set -euo pipefail
DEV=${1:-cuda}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WS=$(mktemp -d)/ws
python3 -m cuda_agent.cli workspace "$REPO/examples/tasks/axpby.py" "$WS" --device "$DEV" >/dev/null
cp "$REPO/examples/solutions/axpby_$DEV/model_new.py" "$WS/"
cp "$REPO/examples/solutions/axpby_$DEV/kernels/"* "$WS/kernels/"
cd "$WS"
t() { local s=$(date +%s%N); "$@" > /tmp/iter.log 2>&1 || { cat /tmp/iter.log; exit 1; }; local e=$(date +%s%N); echo "$(( (e - s) / 1000000 )) ms: $*  ($(grep -m1 -E 'Compile success|verify success|FAIL' /tmp/iter.log))"; }
t bash utils/compile.sh
t python3 -m utils.verification
K=kernels/$(ls kernels | grep -v binding | head -1)
for i in 1 2 3; do
  echo "// edit $i" >> "$K"
  t bash utils/compile.sh
  t python3 -m utils.verification
done
