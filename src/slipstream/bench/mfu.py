"""Model FLOPs utilisation: the FLOPs a training token costs, and the peak the machine probe
measured to divide them by."""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.wrap import local_module
from ..models import unwrap


def model_flops_per_token(model: Any, row_len: int) -> float:
    """Training FLOPs per token: the model's own formula when it has one (the built-in GPT counts
    attention, 6N + 12·L·d·T), else 6 x its parameters; 0 without a model."""
    if model is None:
        return 0.0
    model = unwrap(local_module(model))
    own = getattr(model, "flops_per_token", None)
    if callable(own) and row_len:
        return float(own(row_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


def peak_flops_from_probe(device: torch.device) -> dict[str, float]:
    """The MFU denominator per dtype: the best matmul rate the machine probe measured (cached).
    A dtype the probe could not measure falls back to fp32's figure."""
    from ..machine import probe

    p = probe(device)
    fp32 = p.flops("fp32") or 1.0
    return {d: p.flops(d) or fp32 for d in ("fp32", "bf16", "fp16")}
