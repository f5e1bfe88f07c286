"""Benchmarks, workloads and baselines of Coalesce; results land in ``perf/results/``."""
