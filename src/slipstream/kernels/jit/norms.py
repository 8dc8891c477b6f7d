"""Triton kernels for norms (imported on first launch only; see ``slipstream.kernels.jit``)."""

import triton
import triton.language as tl


@triton.jit
def norm_fwd(
    X, R, Y, H, W, B, MEAN, RSTD,
    x_stride, r_stride, y_stride, h_stride,
    n_cols, eps,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # normalise the rounded sum, exactly what the unfused `norm(x + r)` sees
        h = x.to(H.dtype.element_ty)
        tl.store(H + row * h_stride + cols, h, mask=mask)
        x = h.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        tl.store(MEAN + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd(
    X, DY, DH, DX, W, MEAN, RSTD, DW_PART, DB_PART,
    x_stride, dy_stride, dh_stride, dx_stride,
    n_rows, n_cols, rows_per_program,
    IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    # int64 loop bounds make the row index (and row * stride) int64 on the GPU
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = dy
        if HAS_W:
            wdy = dy * w
        # d/dx of (x - mean) * rstd, contracted with wdy; masked columns are 0 in every term
        c1 = tl.sum(xhat * wdy, axis=0) / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / n_cols
            dx = (wdy - xhat * c1 - c2) * rstd
        if HAS_DRES:
            # gradient that reached the residual-stream output h directly
            dx += tl.load(DH + row * dh_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * dx_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_B:
            db += dy
    # every program writes its partial rows, even one that got no rows (zeros)
    if HAS_W:
        tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB_PART + pid * n_cols + cols, db, mask=mask)
