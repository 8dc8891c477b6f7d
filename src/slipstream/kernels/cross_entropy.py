"""Softmax cross-entropy: one Triton program per row, loss and logit-gradient in a single launch.

Conditional execution: a row whose target is ``ignore_index`` skips both softmax passes (no reads of
its logits at all) but still writes its loss (0) and, when asked, a zero gradient row. Liger #1338 is
the lesson: an early exit that leaves an output unwritten corrupts results silently.

The gradient is computed in the forward pass (``softmax - onehot``, times a per-row scale) and stored
in place of what torch would save anyway (its log-softmax, same size), so backward is one multiply.
"""

from __future__ import annotations

import functools

import torch

from .alternatives import alternative
from .dispatch import (
    ALTERNATIVES,
    check_launchable,
    new_output,
    next_power_of_2,
    resolve_backend,
    triton_lang,
)
from .reference import cross_entropy as _reference

# Column tile: large enough to stream a row in few iterations, small enough not to spill registers
# (Liger found 32k elements best on H100; 8k keeps the tile fp32-resident on smaller parts too).
MAX_BLOCK = 8192
NUM_WARPS = 16


@functools.cache
def _kernels():
    triton_lang()  # a readable error if triton is missing
    from .jit import cross_entropy as jit

    return jit.ce_rows_kernel


def ce_rows_triton(logits, target, ignore_index: int, row_scale, loss_out, grad_out=None) -> None:
    """Launch the row kernel: writes ``loss_out`` and (if given) ``grad_out``, which may be ``logits``."""
    check_launchable(logits, target)
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if logits.stride(-1) != 1 or (grad_out is not None and grad_out.stride(-1) != 1):
        raise ValueError("cross-entropy kernel needs logits and gradient contiguous in the vocab dim")
    block = min(MAX_BLOCK, next_power_of_2(n_cols))
    g = grad_out if grad_out is not None else logits  # never written when WRITE_GRAD is off
    _kernels()[(n_rows,)](
        logits,
        logits.stride(0),
        g,
        g.stride(0),
        target.contiguous(),
        row_scale.contiguous(),
        loss_out,
        n_cols,
        ignore_index,
        WRITE_GRAD=grad_out is not None,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )


def row_scale_for(target, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-row gradient scale, computed on the device without a host sync.

    ``mean`` divides by the number of non-ignored rows like torch; with none valid it is inf, which
    only ignored rows (scale forced to 0) would see, and the mean loss is 0/0 = NaN, as in torch.
    """
    valid = target != ignore_index
    if reduction == "mean":
        scale = 1.0 / valid.sum().to(torch.float32)
        return torch.where(valid, scale, 0.0)
    if reduction in ("sum", "none"):
        return valid.to(torch.float32)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def reduce_loss(loss_rows, target, ignore_index: int, reduction: str):
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)


class TritonCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index: int, reduction: str):
        row_scale = row_scale_for(target, ignore_index, reduction)
        loss_rows = new_output(target.shape, torch.float32, logits.device)
        grad = None
        if ctx.needs_input_grad[0]:
            grad = new_output(logits.shape, logits.dtype, logits.device)
        ce_rows_triton(logits, target, ignore_index, row_scale, loss_rows, grad)
        ctx.save_for_backward(grad)
        return reduce_loss(loss_rows, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        # the per-row scale of softmax-onehot is exact, so the upstream gradient is one multiply
        g = grad_loss[:, None] if grad_loss.dim() == 1 else grad_loss
        return (grad * g).to(grad.dtype), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy`` for [rows, classes] logits (hard labels, no class weights or smoothing).

    The loss is float32 whatever the logits dtype (torch returns the logits dtype; fp32 is what
    autocast gives and what training wants). Targets outside [0, classes) other than ``ignore_index``
    are not checked on the Triton path (checking would cost a host sync).
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy wants logits [rows, classes] and target [rows], got {tuple(logits.shape)} "
            f"and {tuple(target.shape)}: flatten batch and time first"
        )
    row_scale_for(target[:0], ignore_index, reduction)  # validates `reduction` on either path
    b = resolve_backend(backend, logits.device)
    if b == "torch":
        return _reference(logits, target, ignore_index, reduction).float()
    if b in ALTERNATIVES:
        return alternative("cross_entropy", b)(logits, target, ignore_index, reduction).float()
    return TritonCrossEntropy.apply(logits.contiguous(), target, ignore_index, reduction)
