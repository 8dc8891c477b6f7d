"""Static-shape, mask-free helpers: no data-dependent shapes, no host syncs in the hot path.

`x[mask]` has a shape that depends on the data, so torch.compile must guard on it (or graph-break)
and CUDA must tell the host how many elements came out (a sync). `loss.item()` or `int(mask.sum())`
also waits for the device. The helpers below keep every shape fixed by the batch shape and return
device tensors, so the step stays asynchronous and one compiled graph serves every batch.

    # before: a data-dependent shape and a sync per step
    loss = per_token[labels != -100].mean()
    n = int((labels != -100).sum())
    # after: fixed shapes, no sync, and 0 (not nan) for a batch with no real token
    loss = masked_mean(per_token, labels != -100)
    n = count_tokens(labels)
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def token_weights(
    labels: Tensor, ignore_index: int = IGNORE_INDEX, dtype: torch.dtype = torch.float32
) -> Tensor:
    """1.0 where a label counts, 0.0 where it is ignored: multiply instead of indexing."""
    return (labels != ignore_index).to(dtype)


def count_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of counted labels as a 0-d device tensor (read it with .item() only off the hot path)."""
    return (labels != ignore_index).sum()


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of x where mask is true. torch.where, not x * mask, so inf/nan at masked-out positions
    (e.g. logits of padding) cannot leak into the result."""
    kept = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of x where mask is true; 0 (not nan) where nothing is selected."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def weighted_select(x: Tensor, mask: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Static-shape replacement for x[mask] (mask over x's leading dims).

    Returns (out, valid): out has `capacity` rows holding the selected rows of x in order, zeros
    after them; valid marks the filled rows. Rows past `capacity` are discarded, never an error,
    so pick capacity from the batch shape (e.g. B * T). Gradients flow to the selected rows.
    """
    flat_mask = mask.reshape(-1)
    flat_x = x.reshape(flat_mask.shape[0], *x.shape[mask.dim() :])
    slot = torch.cumsum(flat_mask.to(torch.int64), 0) - 1
    keep = flat_mask & (slot < capacity)
    # Unselected rows are added into one spare slot at the end, which is then cut off.
    index = torch.where(keep, slot, torch.full_like(slot, capacity))
    out = flat_x.new_zeros((capacity + 1, *flat_x.shape[1:])).index_add(0, index, flat_x)[:capacity]
    valid = torch.arange(capacity, device=x.device) < keep.sum()
    return out, valid


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum of values per segment id in [0, num_segments) with a fixed output shape (no loop over
    documents, no unique()): e.g. per-document loss from per-token loss and document ids."""
    out = values.new_zeros(num_segments)
    return out.index_add(0, segment_ids.reshape(-1), values.reshape(-1))
