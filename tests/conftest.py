"""Shared test set-up: one build cache per test session (so tests share compiled builds),
and GPU tests skipped where there is no CUDA device."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Before anything imports cuda_agent.paths users: one cache per test run, made by the
# process pytest was started as and removed by it at the end (builds and precompiled headers
# come to about a gigabyte per run), or a persistent one when CUDA_AGENT_TEST_CACHE is set
# (keeps the precompiled headers between runs). pytest-xdist's workers inherit the run's
# through the environment and share it (builds and baselines are locked and written
# atomically), so each build and each baseline is made once per run.
_RUN_CACHE = "CUDA_AGENT_TEST_RUN_CACHE"
_made_here = False
if os.environ.get("CUDA_AGENT_TEST_CACHE"):
    _cache = os.environ["CUDA_AGENT_TEST_CACHE"]
elif os.environ.get(_RUN_CACHE) and os.environ.get("PYTEST_XDIST_WORKER"):
    _cache = os.environ[_RUN_CACHE]  # a worker: the run's
else:
    _cache = tempfile.mkdtemp(prefix="cuda-agent-test-cache-")
    os.environ[_RUN_CACHE] = _cache
    _made_here = True
os.environ["CUDA_AGENT_CACHE"] = _cache


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# On a machine without a GPU the suite shares two cores between two tests at a time: the
# evaluations that name no timing protocol (the agent's, the bench's, the CLI's) get a
# shorter, looser one (see timing.default_protocol); the GPU tests keep the default.
if not _cuda_available():
    os.environ.setdefault("CUDA_AGENT_PROTOCOL", "budget_s=2,target_rel_ci=0.02")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # (xdist's workers have finished by the time the process that made the cache gets here)
    if _made_here and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_cache, ignore_errors=True)
