"""Benchmarks over task suites: solutions or agent episodes on a worker pool, metrics, reports."""
