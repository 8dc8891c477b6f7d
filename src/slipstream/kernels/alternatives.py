"""Kernels that are not ours, behind the same call as ours: Liger-Kernel's Triton ops, and inductor's
code for the pure-torch reference (``torch.compile`` of ``reference.<op>``).

On the first H200 run six of our seven Triton kernels lost to eager torch, so ``kernels.ops=auto``
no longer assumes ours are fastest: it times these beside ours (slipstream.kernels.chooser) and
installs whichever wins, through the ``backend`` argument every op function already takes. Each
function here has the signature of the matching ``reference`` function.

Liger-Kernel is optional (``pip install 'slipstream[gpu]'``) and CUDA-only; it is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import reference

# op -> the reference function inductor compiles; gelu_tanh and cross_entropy included.
_REFERENCE: dict[str, Callable] = {
    "rms_norm": reference.rms_norm,
    "layer_norm": reference.layer_norm,
    "swiglu": reference.swiglu,
    "gelu_tanh": reference.gelu_tanh,
    "cross_entropy": reference.cross_entropy,
    "linear_cross_entropy": reference.linear_cross_entropy,
}

# Ops Liger-Kernel has (it has no plain tanh-GELU, only the gated GeGLU).
LIGER_OPS = frozenset({"rms_norm", "layer_norm", "swiglu", "cross_entropy", "linear_cross_entropy"})

_COMPILED: dict[str, Callable] = {}


def compiled(op: str) -> Callable:
    """``torch.compile`` of the op's torch reference, built once per op (inductor fuses it the way a
    whole-model compile would, but in an eager model)."""
    fn = _COMPILED.get(op)
    if fn is None:
        fn = _COMPILED[op] = torch.compile(_REFERENCE[op], dynamic=False)
    return fn


def _liger_rms_norm(x, weight=None, eps=None):
    from liger_kernel.transformers.functional import liger_rms_norm

    if weight is None:  # Liger's kernel always scales
        weight = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    # in_place=False: Liger's default overwrites the incoming gradient, which autograd may still hold
    return liger_rms_norm(x, weight, eps, in_place=False)


def _liger_layer_norm(x, weight=None, bias=None, eps=1e-5):
    from liger_kernel.transformers.functional import liger_layer_norm

    n = x.shape[-1]
    weight = torch.ones(n, device=x.device, dtype=x.dtype) if weight is None else weight
    bias = torch.zeros(n, device=x.device, dtype=x.dtype) if bias is None else bias
    return liger_layer_norm(x, weight, bias, eps)


def _liger_swiglu(gate, up):
    from liger_kernel.transformers.functional import liger_swiglu

    return liger_swiglu(gate, up)


def _liger_cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction).float()


def _liger_linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(
        x, weight, target, bias, ignore_index=ignore_index, reduction=reduction
    )
    return loss.float()


_LIGER: dict[str, Callable] = {
    "rms_norm": _liger_rms_norm,
    "layer_norm": _liger_layer_norm,
    "swiglu": _liger_swiglu,
    "cross_entropy": _liger_cross_entropy,
    "linear_cross_entropy": _liger_linear_cross_entropy,
}


def alternative(op: str, backend: str) -> Callable:
    """The ``backend`` (``liger`` or ``compile``) implementation of ``op``, called like ``reference.<op>``."""
    if backend == "compile":
        return compiled(op)
    if backend == "liger":
        if op not in _LIGER:
            raise ValueError(f"Liger-Kernel has no {op} kernel: use backend 'triton', 'torch' or 'compile'")
        return _LIGER[op]
    raise ValueError(f"no alternative backend {backend!r}: choose 'liger' or 'compile'")
