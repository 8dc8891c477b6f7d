"""Thin modules over the kernel functions, built *from* an existing module so that swapping keeps the
very same Parameter objects (optimizer state and state_dict keys stay valid).

Each class subclasses the torch module it replaces, so ``isinstance(m, nn.LayerNorm)`` still holds
and its ``extra_repr`` still prints the configuration.
"""

from __future__ import annotations

import math

from torch import nn

from .activations import gelu_tanh, swiglu
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .norms import layer_norm, rms_norm


class KernelModule:
    """Mixin marking a module installed by ``apply_kernels``; ``backend`` is ``triton`` or ``torch``."""

    backend: str = "auto"

    @classmethod
    def adopt(cls, old: nn.Module, backend: str, **attrs):
        """A ``cls`` instance sharing ``old``'s parameters, buffers, children and settings."""
        new = cls.__new__(cls)
        # dict-valued attributes (_parameters, hooks, ...) get their own container, same contents
        for key, value in old.__dict__.items():
            new.__dict__[key] = value.copy() if isinstance(value, dict) else value
        new.__dict__.update(attrs, backend=backend)
        return new


def _flatten_trailing(x, normalized_shape, *params):
    """Norms over several trailing dims become norms over one: the kernels work on rows."""
    k = len(normalized_shape)
    if k == 1:
        return x, params
    flat = x.reshape(*x.shape[: x.dim() - k], math.prod(normalized_shape))
    return flat, tuple(None if p is None else p.reshape(-1) for p in params)


class LayerNorm(KernelModule, nn.LayerNorm):
    def forward(self, x):
        flat, (w, b) = _flatten_trailing(x, self.normalized_shape, self.weight, self.bias)
        return layer_norm(flat, w, b, self.eps, backend=self.backend).view(x.shape)


class RMSNorm(KernelModule, nn.RMSNorm):
    def forward(self, x):
        flat, (w,) = _flatten_trailing(x, self.normalized_shape, self.weight)
        return rms_norm(flat, w, self.eps, backend=self.backend).view(x.shape)


class GeluTanh(KernelModule, nn.GELU):
    def forward(self, x):
        return gelu_tanh(x, backend=self.backend)


class CrossEntropyLoss(KernelModule, nn.CrossEntropyLoss):
    def forward(self, input, target):
        if input.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point:
            return super().forward(input, target)  # class-dim layouts and soft labels: torch's op
        return cross_entropy(input, target, self.ignore_index, self.reduction, backend=self.backend)


class SwiGLU(KernelModule, nn.Module):
    slipstream_kernel = "swiglu"

    def forward(self, gate, up):
        return swiglu(gate, up, backend=self.backend)


class LinearCrossEntropy(KernelModule, nn.Module):
    """The model's final projection + loss, without materialising the logits.

    Same call as the loss head it replaces: ``forward(hidden [N, d], weight [V, d], labels [N],
    reduction="mean")``; ``ignore_index`` is taken from the old head when it has one (else -100).
    """

    slipstream_kernel = "linear_cross_entropy"
    ignore_index: int = -100
    chunk_rows: int | None = None

    def forward(self, hidden, weight, labels, reduction: str = "mean"):
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            ignore_index=self.ignore_index,
            reduction=reduction,
            backend=self.backend,
            chunk_rows=self.chunk_rows,
        )
