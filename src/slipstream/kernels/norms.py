"""RMSNorm, LayerNorm and their fused residual-add variants: one Triton kernel pair for all four.

The variants differ only in compile-time flags (``IS_RMS``, ``HAS_RES``, ``HAS_W``, ``HAS_B``), so
there is one kernel to get right instead of four near-copies. Forward: one program per row, fp32
statistics, saves ``rstd`` (and ``mean``) per row. Backward: a fixed number of persistent programs,
each looping over a contiguous block of rows and keeping its weight/bias-gradient partial sums in
fp32 registers; the few partials are summed by torch (no [rows, hidden] fp32 buffer as in Liger).

The fused residual add returns ``(norm(x + residual), x + residual)``: the pre-norm transformer block
needs both, and computing them in one pass saves a full read and write of the residual stream.
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .alternatives import alternative
from .dispatch import (
    ALTERNATIVES,
    check_launchable,
    new_output,
    next_power_of_2,
    num_programs,
    resolve_backend,
    triton_lang,
)

MAX_ROWS_PER_PROGRAM = 32
MAX_HIDDEN = 65536  # one row must fit one tile; wider rows would need a two-pass kernel


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@functools.cache
def _kernels():
    triton_lang()  # a readable error if triton is missing
    from .jit import norms as jit

    return jit.norm_fwd, jit.norm_bwd


class TritonNorm(torch.autograd.Function):
    """Autograd for ``(y, h) = norm(x [+ residual])``; ``h`` is None without a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        check_launchable(x)
        shape = x.shape
        n_cols = shape[-1]
        if n_cols > MAX_HIDDEN:
            raise ValueError(f"Triton norm supports hidden size up to {MAX_HIDDEN}, got {n_cols}")
        x2 = x.reshape(-1, n_cols).contiguous()
        r2 = None if residual is None else residual.reshape(-1, n_cols).contiguous()
        n_rows = x2.shape[0]
        block = next_power_of_2(n_cols)
        y = new_output(x2.shape, x.dtype, x.device)
        h = None if r2 is None else new_output(x2.shape, x.dtype, x.device)
        rstd = new_output((n_rows,), torch.float32, x.device)
        mean = None if is_rms else new_output((n_rows,), torch.float32, x.device)
        if n_rows:
            norm_fwd, _ = _kernels()
            norm_fwd[(n_rows,)](
                x2, r2, y, h, weight, bias, mean, rstd,
                x2.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0), 0 if h is None else h.stride(0),
                n_cols, eps,
                IS_RMS=is_rms, HAS_RES=r2 is not None, HAS_W=weight is not None, HAS_B=bias is not None,
                BLOCK=block, num_warps=_num_warps(block),
            )  # fmt: skip
        ctx.save_for_backward(x2 if h is None else h, weight, bias, mean, rstd)
        ctx.meta = (shape, is_rms, residual is not None, block)
        if h is None:
            return y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        xin, weight, bias, mean, rstd = ctx.saved_tensors
        shape, is_rms, has_res, block = ctx.meta
        n_rows, n_cols = xin.shape
        dy = dy.reshape(-1, n_cols).contiguous()
        dh = None if (dh is None or not has_res) else dh.reshape(-1, n_cols).contiguous()
        dx = new_output(xin.shape, xin.dtype, xin.device)
        # at most MAX_ROWS_PER_PROGRAM rows summed sequentially per partial (fp32 accuracy of dW);
        # at least a full wave of programs on the GPU
        programs = max(num_programs(xin.device), -(-n_rows // MAX_ROWS_PER_PROGRAM))
        programs = max(1, min(n_rows, programs))
        rows_per = -(-n_rows // programs)
        programs = -(-n_rows // rows_per)
        dw_part = None if weight is None else new_output((programs, n_cols), torch.float32, xin.device)
        db_part = None if bias is None else new_output((programs, n_cols), torch.float32, xin.device)
        if n_rows:
            _, norm_bwd = _kernels()
            norm_bwd[(programs,)](
                xin, dy, dh, dx, weight, mean, rstd, dw_part, db_part,
                xin.stride(0), dy.stride(0), 0 if dh is None else dh.stride(0), dx.stride(0),
                n_rows, n_cols, rows_per,
                IS_RMS=is_rms, HAS_DRES=dh is not None, HAS_W=weight is not None, HAS_B=bias is not None,
                BLOCK=block, num_warps=_num_warps(block),
            )  # fmt: skip
        dw = None if weight is None else dw_part.sum(0).to(weight.dtype)
        db = None if bias is None else db_part.sum(0).to(bias.dtype)
        dx = dx.view(shape)
        # x and residual get the same gradient; a clone keeps their .grad tensors from aliasing
        dres = None if not has_res else (dx.clone() if ctx.needs_input_grad[0] else dx)
        return dx, dres, dw, db, None, None


def _check(x, weight, bias, residual=None):
    n = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x in shape and dtype, got {tuple(residual.shape)} {residual.dtype} "
            f"vs {tuple(x.shape)} {x.dtype}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (n,):
            raise ValueError(
                f"norm {name} must have shape ({n},) to match x's last dim, got {tuple(p.shape)}"
            )


def _fused_add_backend(backend: str, device) -> str:
    b = resolve_backend(backend, device)
    if b in ALTERNATIVES:
        raise ValueError(f"the fused add+norm ops have no {b!r} backend: use 'auto', 'triton' or 'torch'")
    return b


def _rms_eps(x, eps):
    # nn.RMSNorm's eps=None means the dtype's machine epsilon
    return torch.finfo(x.dtype).eps if eps is None else eps


def rms_norm(x, weight=None, eps: float | None = None, backend: str = "auto"):
    """``F.rms_norm`` over the last dimension."""
    _check(x, weight, None)
    b = resolve_backend(backend, x.device)
    if b == "torch":
        return reference.rms_norm(x, weight, eps)
    if b in ALTERNATIVES:
        return alternative("rms_norm", b)(x, weight, eps)
    return TritonNorm.apply(x, None, weight, None, _rms_eps(x, eps), True)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, backend: str = "auto"):
    """``F.layer_norm`` over the last dimension."""
    _check(x, weight, bias)
    b = resolve_backend(backend, x.device)
    if b == "torch":
        return reference.layer_norm(x, weight, bias, eps)
    if b in ALTERNATIVES:
        return alternative("layer_norm", b)(x, weight, bias, eps)
    return TritonNorm.apply(x, None, weight, bias, eps, False)


def add_rms_norm(x, residual, weight=None, eps: float | None = None, backend: str = "auto"):
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    _check(x, weight, None, residual)
    if _fused_add_backend(backend, x.device) == "torch":
        return reference.add_rms_norm(x, residual, weight, eps)
    return TritonNorm.apply(x, residual, weight, None, _rms_eps(x, eps), True)


def add_layer_norm(x, residual, weight=None, bias=None, eps: float = 1e-5, backend: str = "auto"):
    """``(layer_norm(x + residual), x + residual)`` in one pass."""
    _check(x, weight, bias, residual)
    if _fused_add_backend(backend, x.device) == "torch":
        return reference.add_layer_norm(x, residual, weight, bias, eps)
    return TritonNorm.apply(x, residual, weight, bias, eps, False)
