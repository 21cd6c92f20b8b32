"""Locked workspace commands. Each is a thin front for cuda-agent's trusted evaluator,
which builds and checks a clean copy of model_new.py and kernels/, not this directory."""
