#!/usr/bin/env bash
# Locked: builds kernels/ + binding.cpp into cuda_extension.so through cuda-agent's
# incremental, cached, sandboxed build. Only changed files are recompiled.
cd "$(dirname "$0")/.." || exit 1
exec python3 -m utils.compile "$@"
