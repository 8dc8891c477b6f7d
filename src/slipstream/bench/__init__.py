"""Side-by-side benchmarks of recipes and peers, with reports."""

from .runner import BenchResult, ContenderResult, run_bench

__all__ = ["BenchResult", "ContenderResult", "run_bench"]
