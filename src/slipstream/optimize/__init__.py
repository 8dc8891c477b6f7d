"""`slipstream optimize`: the fastest recipe for a workload on this machine, found by measurement and
guarded by loss parity (see search.py)."""

from .search import DEFAULT_STAGES, STAGES, Candidate, OptimizeResult, optimize

__all__ = ["DEFAULT_STAGES", "STAGES", "Candidate", "OptimizeResult", "optimize"]
