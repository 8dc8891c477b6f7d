"""MLP activations with the gating multiply fused: SwiGLU, GeGLU(tanh), and plain GELU(tanh).

Unfused, ``silu(gate) * up`` writes ``silu(gate)`` to memory, reads it back for the multiply, and
autograd keeps it for backward. Fused, forward reads gate and up once and writes the product once;
backward recomputes the activation from ``gate`` (cheap arithmetic) instead of storing it.
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .alternatives import alternative
from .dispatch import ALTERNATIVES, check_launchable, new_output, resolve_backend, triton_lang

BLOCK = 1024  # elementwise tile
SILU, GELU_TANH = 0, 1


@functools.cache
def _kernels():
    triton_lang()  # a readable error if triton is missing
    from .jit import activations as jit

    return jit.act_fwd, jit.act_bwd


class TritonGatedActivation(torch.autograd.Function):
    """``act(gate) * up`` (or ``act(gate)`` when ``up`` is None) with the activation recomputed in backward."""

    @staticmethod
    def forward(ctx, gate, up, act: int):
        check_launchable(gate)
        gate = gate.contiguous()
        up = None if up is None else up.contiguous()
        y = new_output(gate.shape, gate.dtype, gate.device)
        n = gate.numel()
        if n:
            act_fwd, _ = _kernels()
            act_fwd[(triton_cdiv(n, BLOCK),)](gate, up, y, n, ACT=act, HAS_UP=up is not None, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg = new_output(gate.shape, gate.dtype, gate.device)
        du = None if up is None else new_output(up.shape, up.dtype, up.device)
        n = gate.numel()
        if n:
            _, act_bwd = _kernels()
            act_bwd[(triton_cdiv(n, BLOCK),)](
                gate, up, dy, dg, du, n, ACT=ctx.act, HAS_UP=up is not None, BLOCK=BLOCK
            )
        return dg, du, None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_pair(gate, up):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up``."""
    _check_pair(gate, up)
    b = resolve_backend(backend, gate.device)
    if b == "torch":
        return reference.swiglu(gate, up)
    if b in ALTERNATIVES:
        return alternative("swiglu", b)(gate, up)
    return TritonGatedActivation.apply(gate, up, SILU)


def geglu_tanh(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``gelu_tanh(gate) * up``."""
    _check_pair(gate, up)
    b = resolve_backend(backend, gate.device)
    if b in ALTERNATIVES:
        raise ValueError(f"geglu_tanh has no {b!r} backend: use 'auto', 'triton' or 'torch'")
    if b == "torch":
        return reference.geglu_tanh(gate, up)
    return TritonGatedActivation.apply(gate, up, GELU_TANH)


def gelu_tanh(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")``."""
    b = resolve_backend(backend, x.device)
    if b == "torch":
        return reference.gelu_tanh(x)
    if b in ALTERNATIVES:
        return alternative("gelu_tanh", b)(x)
    return TritonGatedActivation.apply(x, None, GELU_TANH)
