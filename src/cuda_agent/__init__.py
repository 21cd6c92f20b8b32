"""cuda-agent: an LLM agent, its environment and a trusted evaluator for custom CUDA kernels."""

__version__ = "0.1.0"
