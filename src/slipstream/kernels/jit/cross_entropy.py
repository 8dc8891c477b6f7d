"""Triton kernels for cross entropy (imported on first launch only; see ``slipstream.kernels.jit``)."""

import triton
import triton.language as tl


@triton.jit
def ce_rows_kernel(
    X,  # [rows, n_cols] logits, any float dtype
    x_stride,
    G,  # [rows, n_cols] gradient out (may alias X: each element is read before it is written)
    g_stride,
    T,  # [rows] int targets
    S,  # [rows] fp32 per-row gradient scale (1/n_valid for mean, 1 for sum, grad_out for none)
    LOSS,  # [rows] fp32 per-row loss, unscaled
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 row offset: rows * vocab overflows int32 at 128k vocab and 16k tokens
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    G += row * g_stride
    y = tl.load(T + row)
    cols = tl.arange(0, BLOCK)
    if y == ignore_index:
        # skip the softmax passes, but every output of this row is still written
        tl.store(LOSS + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                tl.store(G + offs, zeros.to(G.dtype.element_ty), mask=offs < n_cols)
    else:
        x_y = tl.load(X + y).to(tl.float32)  # read before G (which may alias X) overwrites it
        # pass 1, online softmax (Milakov & Gimelshein 2018): running max m and sum d
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            x = tl.load(X + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        tl.store(LOSS + row, lse - x_y)
        if WRITE_GRAD:
            s = tl.load(S + row)
            # pass 2: grad = scale * (softmax - onehot(y)), fp32 math, one rounding at the store
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                x = tl.load(X + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
                # exp(x - m) / d, not exp(x - lse): lse carries an absolute rounding error that
                # would become a relative error of every probability
                g = tl.exp(x - m) / d - tl.where(offs == y, 1.0, 0.0)
                tl.store(G + offs, (g * s).to(G.dtype.element_ty), mask=offs < n_cols)
