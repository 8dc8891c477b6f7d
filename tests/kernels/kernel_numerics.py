"""The accuracy rule for kernel tests (FlashAttention's): in a given dtype, a kernel's error against a
float64 ground truth may be at most twice the error the torch reference makes in that same dtype.

A floor of one unit in the last place of the dtype at the output's largest magnitude is added: an
output rounded to the dtype is that far off even when computed exactly, and a reference that happens
to land exactly (zero error) must not demand the impossible. fp32 and bf16 thus get tolerances that
scale with how hard each case really is, rather than a hand-picked rtol per dtype.
"""

from __future__ import annotations

import torch


def assert_within_ref_error(name: str, ours, ref, truth, dtype: torch.dtype, factor: float = 2.0):
    ours, ref, truth = ours.detach().double(), ref.detach().double(), truth.detach().double()
    assert ours.shape == truth.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(truth.shape)}"
    nan = torch.isnan(truth)
    # where the truth is NaN (torch's mean over zero targets), the kernel must give NaN too
    assert torch.equal(torch.isnan(ours), nan), f"{name}: NaN pattern differs from torch (unwritten output?)"
    ours, ref, truth = ours[~nan], ref[~nan], truth[~nan]
    if truth.numel() == 0:
        return
    err = (ours - truth).abs().max().item()
    ref_err = (ref - truth).abs().nan_to_num(0.0).max().item()
    floor = torch.finfo(dtype).eps * truth.abs().max().item()
    tol = factor * ref_err + floor
    assert err <= tol, f"{name}: error {err:.3g} > {factor}x reference error {ref_err:.3g} + ulp {floor:.3g}"


def grads(out, inputs, upstream=None):
    """Gradients of ``sum(out * upstream)`` w.r.t. the inputs that require grad (None for the others)."""
    upstream = torch.ones_like(out) if upstream is None else upstream.to(out.dtype)
    want = [t for t in inputs if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, want, upstream))
    return [next(got) if (t is not None and t.requires_grad) else None for t in inputs]


def leaves(*tensors, dtype, device, requires_grad=True):
    """Copies in ``dtype`` (and float64 truths) of the given float32 tensors, as fresh autograd leaves."""
    return [
        None if t is None else t.to(device=device, dtype=dtype).detach().requires_grad_(requires_grad)
        for t in tensors
    ]
