"""Triton kernels for activations (imported on first launch only; see ``slipstream.kernels.jit``)."""

import triton
import triton.language as tl


@triton.jit
def act_and_grad(g, ACT: tl.constexpr):
    """Activation a(g) and its derivative a'(g), in fp32."""
    if ACT == 0:  # silu: g * sigmoid(g)
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    else:  # gelu tanh: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = k (g + 0.044715 g^3)
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g))
        a = g * s
        da = s + 2.0 * k * g * s * (1.0 - s) * (1.0 + 3.0 * 0.044715 * g * g)
    return a, da


@triton.jit
def act_fwd(G, U, Y, n, ACT: tl.constexpr, HAS_UP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = act_and_grad(g, ACT)
    if HAS_UP:
        y = y * tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def act_bwd(G, U, DY, DG, DU, n, ACT: tl.constexpr, HAS_UP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = act_and_grad(g, ACT)
    if HAS_UP:
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)
        dy = dy * u
    tl.store(DG + offs, (dy * da).to(DG.dtype.element_ty), mask=mask)
