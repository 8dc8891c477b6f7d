"""Pure-torch references: the definition of what every kernel must compute.

Tests compare kernels against these (run in float64 for the ground truth and in the test dtype for the
reference's own error); the CPU dispatch path uses them directly where torch has nothing better.
"""

from __future__ import annotations

import math

import torch.nn.functional as F

Reduction = str  # "mean" | "sum" | "none", as in torch


def cross_entropy(logits, target, ignore_index: int = -100, reduction: Reduction = "mean"):
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(x, weight, target, bias=None, ignore_index: int = -100, reduction="mean"):
    """Materialises the full [tokens, vocab] logits: the memory cost the fused op avoids."""
    return F.cross_entropy(F.linear(x, weight, bias), target, ignore_index=ignore_index, reduction=reduction)


def rms_norm(x, weight=None, eps: float | None = None):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_rms_norm(x, residual, weight=None, eps: float | None = None):
    """Returns (norm(x + residual), x + residual): the pre-norm block's next input and residual stream."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def add_layer_norm(x, residual, weight=None, bias=None, eps: float = 1e-5):
    h = x + residual
    return layer_norm(h, weight, bias, eps), h


def swiglu(gate, up):
    return F.silu(gate) * up


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def geglu_tanh(gate, up):
    return F.gelu(gate, approximate="tanh") * up


# sqrt(2 / pi), the constant of the tanh approximation of GELU
GELU_K = math.sqrt(2.0 / math.pi)
