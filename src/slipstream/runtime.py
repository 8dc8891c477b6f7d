"""The recipe's `runtime` section applied to the process: which device, and seeding (with the
deterministic switches put back afterwards, so one deterministic run does not slow down whatever
the process runs next)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch

from .errors import RecipeError


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RecipeError("runtime.device=cuda but no CUDA device is visible; use runtime.device=auto or cpu")
    return torch.device(choice)


def seed_everything(seed: int, deterministic: bool) -> Callable[[], None]:
    """Seed every RNG; with `deterministic`, switch torch to deterministic algorithms. Returns the
    function that puts the process-wide switches back as they were (Session.close calls it), so
    one deterministic run does not slow down whatever the process runs next."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if not deterministic:
        return lambda: None
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    if torch.cuda.is_available():
        # deterministic cuBLAS needs a fixed workspace, or its first call raises; a user's own
        # setting is kept
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False

    def restore() -> None:
        enabled, warn_only, benchmark, cublas = before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas

    return restore


__all__ = ["resolve_device", "seed_everything"]
