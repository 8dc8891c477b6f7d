"""Built-in workloads: a real corpus and models to train on it, registered by name."""

from . import user as _user  # noqa: F401  (registers the `user:...` family of names)
from .registry import WORKLOADS, Workload, WorkloadData, get_workload, register_workload, workload_slug

__all__ = ["WORKLOADS", "Workload", "WorkloadData", "get_workload", "register_workload", "workload_slug"]
