"""``leapdecode bench``: Spec-Bench-style benchmark of leapdecode's methods and peer systems."""

from .stats import first_divergence, summarize
from .suite import BenchConfig, run_bench
from .workloads import load_jsonl, load_workload, select

__all__ = ["BenchConfig", "run_bench", "summarize", "first_divergence", "load_jsonl", "load_workload", "select"]
