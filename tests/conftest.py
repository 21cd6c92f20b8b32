"""Shared test set-up: one build cache per test session (so tests share compiled builds),
and GPU tests skipped where there is no CUDA device."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before anything imports cuda_agent.paths users: a session-wide cache, or a persistent one
# when CUDA_AGENT_TEST_CACHE is set (keeps the precompiled headers between runs).
# Under pytest-xdist the workers of one run share it (builds and baselines are locked and
# written atomically), so each build and each baseline is made once per run.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if os.environ.get("CUDA_AGENT_TEST_CACHE"):
    _cache = os.environ["CUDA_AGENT_TEST_CACHE"]
elif _run:
    _cache = os.path.join(tempfile.gettempdir(), f"cuda-agent-test-cache-{_run}")
    os.makedirs(_cache, exist_ok=True)
else:
    _cache = tempfile.mkdtemp(prefix="cuda-agent-test-cache-")
os.environ["CUDA_AGENT_CACHE"] = _cache

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
