"""Fused linear + cross-entropy: the loss of ``x @ weight.T + bias`` without the [tokens, vocab] logits.

Tokens are processed in chunks. For each chunk the logits are formed, turned into loss and
``d loss / d logits`` at once (Triton row kernel on CUDA, in-place torch ops on CPU), and immediately
contracted into the input gradient (chunk rows) and the weight/bias gradient (accumulated in fp32 over
chunks: accumulating bf16 partial sums diverged in Liger #512/#827). Only one chunk of logits is ever
alive, so peak memory is O(chunk * vocab) instead of O(tokens * vocab).

For ``mean``/``sum`` the gradients are computed in the forward pass (the upstream gradient is then a
scalar multiply). For ``none`` the upstream gradient is a per-row vector that the weight gradient
cannot absorb after the fact, so the forward computes only the loss and backward recomputes the chunks.

On the torch path on CPU rows whose target is ``ignore_index`` are dropped before the matmul: padding
and prompt tokens cost nothing (conditional execution without a kernel). Off the CPU that selection
would sync with the host (and break CUDA-graph capture), so there every row is computed.
"""

from __future__ import annotations

import math

import torch

from .alternatives import alternative
from .cross_entropy import ce_rows_triton, reduce_loss, row_scale_for
from .dispatch import ALTERNATIVES, new_output, next_power_of_2, resolve_backend


def default_chunk_rows(n_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that one chunk of logits is about the size of the input ``x`` (Liger's rule)."""
    chunks = math.ceil(vocab / max(hidden, 1))
    return max(1, min(n_rows, next_power_of_2(math.ceil(n_rows / chunks))))


def _ce_rows_torch(logits, target, ignore_index: int, row_scale, loss_out, want_grad: bool):
    """CPU twin of the Triton row kernel; turns ``logits`` (fp32, owned) into the gradient in place."""
    picked = logits.gather(1, target.clamp_min(0)[:, None])
    m = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(m).exp_()  # in place: no second [chunk, vocab] buffer
    d = probs.sum(dim=1, keepdim=True)
    loss = (m + d.log() - picked).squeeze(1)
    loss_out.copy_(torch.where(target != ignore_index, loss, 0.0))
    if not want_grad:
        return None
    # scale * (softmax - onehot); exp(x - m) / d keeps each probability's error relative
    probs.mul_(row_scale[:, None] / d)
    probs.scatter_add_(1, target.clamp_min(0)[:, None], -row_scale[:, None])
    return probs


def _skips_ignored_rows(device: torch.device) -> bool:
    """Whether the torch path drops ignored rows before the matmul. Finding them reads the target on
    the host: free on a CPU, a host sync per chunk on a GPU, and a sync inside CUDA-graph capture is
    an error. Off the CPU every row is computed; ignored rows get loss 0 and a zero gradient from
    their zero row scale."""
    return device.type == "cpu"


def _chunk_torch(xc, weight, bias, tc, ignore_index, scale_c, loss_c, want_grad):
    """Loss rows and grad-of-logits for one chunk; on CPU only non-ignored rows are computed."""
    if not _skips_ignored_rows(xc.device):
        logits = torch.nn.functional.linear(xc, weight, bias).float()
        grad = _ce_rows_torch(logits, tc, ignore_index, scale_c, loss_c, want_grad)
        return (None if grad is None else grad.to(xc.dtype)), (None, xc)
    keep = tc != ignore_index
    all_kept = bool(keep.all())
    loss_c.zero_()
    if not bool(keep.any()):
        return None, (None, xc)
    rows = None if all_kept else keep.nonzero().squeeze(1)
    if rows is not None:
        xc, tc, scale_c = xc[rows], tc[rows], scale_c[rows]
    logits = torch.nn.functional.linear(xc, weight, bias).float()
    loss_k = torch.empty(tc.shape, dtype=torch.float32, device=xc.device)
    grad = _ce_rows_torch(logits, tc, ignore_index, scale_c, loss_k, want_grad)
    if rows is None:
        loss_c.copy_(loss_k)
    else:
        loss_c.index_copy_(0, rows, loss_k)
    return (None if grad is None else grad.to(xc.dtype)), (rows, xc)


def _chunk_triton(xc, weight, bias, tc, ignore_index, scale_c, loss_c, want_grad):
    logits = torch.nn.functional.linear(xc, weight, bias).contiguous()
    # the kernel overwrites the logits with their gradient: no second [chunk, vocab] buffer
    ce_rows_triton(logits, tc, ignore_index, scale_c, loss_c, logits if want_grad else None)
    return (logits if want_grad else None), (None, xc)


def _run_chunks(x, weight, bias, target, ignore_index, row_scale, backend, chunk_rows, needs):
    """Shared chunk loop. ``row_scale=None`` computes only the loss. Returns loss rows and grads."""
    n, hidden = x.shape
    want_grad = row_scale is not None and any(needs)
    need_x, need_w, need_b = needs if want_grad else (False, False, False)
    loss_rows = new_output((n,), torch.float32, x.device)
    grad_x = new_output(x.shape, x.dtype, x.device) if need_x else None
    # fp32 accumulators: each chunk's partial is exact to the input dtype, the sum over chunks is fp32
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if need_b else None
    chunk_fn = _chunk_triton if backend == "triton" else _chunk_torch
    scale = row_scale if row_scale is not None else torch.ones(n, dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk_rows):
        end = min(n, start + chunk_rows)
        xc = x[start:end]
        grad, (rows, x_used) = chunk_fn(
            xc,
            weight,
            bias,
            target[start:end],
            ignore_index,
            scale[start:end],
            loss_rows[start:end],
            want_grad,
        )
        if need_x:
            if grad is None:
                grad_x[start:end].zero_()
            elif rows is None:
                torch.mm(grad, weight.to(grad.dtype), out=grad_x[start:end])
            else:
                grad_x[start:end].zero_()
                grad_x[start:end].index_copy_(0, rows, grad @ weight.to(grad.dtype))
        if grad is None:
            continue
        if need_w:
            grad_w.add_(grad.t() @ x_used)
        if need_b:
            grad_b.add_(grad.sum(0, dtype=torch.float32))
    return loss_rows, grad_x, grad_w, grad_b


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, backend, chunk_rows):
        needs = tuple(ctx.needs_input_grad[:3])
        ctx.ignore_index, ctx.reduction, ctx.backend, ctx.chunk_rows = (
            ignore_index,
            reduction,
            backend,
            chunk_rows,
        )
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        if reduction == "none":
            # per-row upstream grads arrive only in backward: compute the loss now, recompute then
            loss_rows, *_ = _run_chunks(
                x, weight, bias, target, ignore_index, None, backend, chunk_rows, needs
            )
            ctx.save_for_backward(x, weight, bias, target)
            return loss_rows
        row_scale = row_scale_for(target, ignore_index, reduction)
        loss_rows, gx, gw, gb = _run_chunks(
            x, weight, bias, target, ignore_index, row_scale, backend, chunk_rows, needs
        )
        ctx.save_for_backward(gx, gw, gb)
        return reduce_loss(loss_rows, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.reduction == "none":
            x, weight, bias, target = ctx.saved_tensors
            needs = tuple(ctx.needs_input_grad[:3])
            row_scale = grad_loss.float() * (target != ctx.ignore_index)
            _, gx, gw, gb = _run_chunks(
                x, weight, bias, target, ctx.ignore_index, row_scale, ctx.backend, ctx.chunk_rows, needs
            )
        else:
            gx, gw, gb = ctx.saved_tensors
            gx = None if gx is None else gx * grad_loss.to(gx.dtype)
            gw = None if gw is None else gw * grad_loss
            gb = None if gb is None else gb * grad_loss
        # fp32 accumulators are rounded once, at the very end, to the parameters' dtype
        gw = None if gw is None else gw.to(ctx.w_dtype)
        gb = None if gb is None else gb.to(ctx.b_dtype)
        return gx, gw, gb, None, None, None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    backend: str = "auto",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias), target)`` without materialising the logits.

    ``x`` is [tokens, hidden] (leading dims are flattened), ``weight`` [vocab, hidden], ``target``
    [tokens] with ``ignore_index`` for positions that carry no loss. The loss is float32. Under autocast
    the matmuls run in the autocast dtype, as ``F.linear`` would.
    """
    hidden = x.shape[-1]
    x = x.reshape(-1, hidden)
    target = target.reshape(-1)
    if weight.dim() != 2 or weight.shape[1] != hidden or target.shape[0] != x.shape[0]:
        raise ValueError(
            f"fused_linear_cross_entropy wants x [tokens, {hidden}], weight [vocab, {hidden}], "
            f"target [tokens]; got {tuple(x.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
        )
    row_scale_for(target[:0], ignore_index, reduction)  # validates `reduction`
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif weight.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}: cast one or use autocast")
    backend = resolve_backend(backend, x.device)
    if backend in ALTERNATIVES:
        with torch.autocast(device_type, enabled=False):
            return alternative("linear_cross_entropy", backend)(
                x, weight, target, bias, ignore_index, reduction
            ).float()
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x.shape[0], hidden, weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return _apply(x, weight, bias, target, ignore_index, reduction, backend, chunk_rows)


# Kept out of torch.compile graphs: the chunk loop is eager by design (data-dependent row selection
# on CPU, one kernel launch per chunk on GPU), and tracing into it only adds graph breaks and recompiles.
# At the very end of the model, the one graph break this costs is cheap. The wrapper is built on first
# use because torch.compiler.disable imports torch._dynamo (seconds, and triton) at `import slipstream`.
_UNCOMPILED: dict[str, object] = {}


def _apply(x, weight, bias, target, ignore_index, reduction, backend, chunk_rows):
    fn = _UNCOMPILED.get("apply")
    if fn is None:
        fn = _UNCOMPILED["apply"] = torch.compiler.disable(FusedLinearCrossEntropy.apply)
    return fn(x, weight, bias, target, ignore_index, reduction, backend, chunk_rows)
