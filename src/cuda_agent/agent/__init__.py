"""The agent: a model in a workspace, calling sandboxed tools until its kernels are done.

Seams: `ModelClient` (client.py: OpenAI-compatible or replay), the tools (tools.py, with
the persistent sandboxed shell of shell.py), the evaluation service that answers the
workspace commands from outside the sandbox (service.py), the loop (loop.py) and the
trajectory it writes (trajectory.py).
"""

from cuda_agent.agent.client import (
           Completion,
           ModelClient,
           ModelError,
           OpenAIClient,
           OpenAIConfig,
           ReplayClient,
           make_client,
)
from cuda_agent.agent.loop import AgentConfig, EpisodeSummary, Progress, run_episode

__all__ = ["AgentConfig", "Completion", "EpisodeSummary", "ModelClient", "ModelError", "OpenAIClient",
           "OpenAIConfig", "Progress", "ReplayClient", "make_client", "run_episode"]
