"""Tuning: learning-rate schedules and range test (torch only), and Optuna-based search
(Fibonacci, evolutionary, Bayesian, random) with pruning and shared storage.

    from slipstream.tune import build_scheduler, lr_find          # no Optuna needed
    from slipstream.tune.search import run_study, choose_method   # needs Optuna (slipstream[tune])
    from slipstream.tune.fibonacci import FibonacciSampler

Optuna is imported only by the modules that need it, so `import slipstream.tune` works without it.
"""

from ..schedules import SCHEDULES, build_scheduler, lr_curve, lr_multiplier
from .lr_finder import LRFindResult, lr_find, lr_find_workload, plot_lr_find, range_test

__all__ = [
    "SCHEDULES",
    "LRFindResult",
    "build_scheduler",
    "lr_curve",
    "lr_find",
    "lr_find_workload",
    "lr_multiplier",
    "plot_lr_find",
    "range_test",
]
