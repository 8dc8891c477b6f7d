"""Next-token sampling for a whole batch on the device: greedy, temperature, top-k and top-p, with
Gumbel noise from a counter-based hash of (seed, step, token id), so a request's tokens depend
only on its own seed and prompt (not on the batch it shared) and no per-request host sync is
needed."""

from __future__ import annotations

import torch
from torch import Tensor


def hash_uniform(seed: Tensor, step: Tensor, vocab: int) -> Tensor:
    """Uniform(0, 1) noise [S, vocab] from (seed, step, token id) alone: batch-independent sampling."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :]
    x = (seed[:, None] * 0x9E3779B1 + step[:, None] * 0x85EBCA77 + ids * 0x2C2B2AE3) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF  # constants < 2**31 keep every product inside int64
    x = x ^ (x >> 15)
    x = (x * 0x6C8E9CF5) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return ((x.double() + 0.5) / 2**32).float().clamp(1e-7, 1 - 1e-7)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    seed: Tensor,
    step: Tensor,
    top_p: Tensor | None = None,
    *,
    any_top_k: bool = True,
) -> Tensor:
    """Next token per row: greedy where temperature == 0, else Gumbel-max over the logits left
    by top-k (0 = all) and then top-p (the smallest set of most likely tokens whose probability
    reaches top_p; 1 = all).

    `any_top_k` is what the caller knows on the host about the batch: with no row asking for
    top-k, the k-th-value search (a full sort) is skipped."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    V = logits.shape[-1]
    if any_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None:
        probs = scaled.softmax(-1)
        sp = probs.sort(dim=-1, descending=True).values
        keep = (sp.cumsum(-1) - sp) < top_p[:, None]  # the most likely token is always kept
        floor = sp.masked_fill(~keep, 2.0).amin(-1, keepdim=True)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    gumbel = -torch.log(-torch.log(hash_uniform(seed, step, V)))
    sampled = (scaled + gumbel).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)
