"""A preallocated key/value cache with one row (slot) per running sequence, for any model.

Continuous batching needs what a Hugging Face `StaticCache` cannot give: every row of a decode
batch writes its new key at its *own* position (sequences joined at different times). `SlotCache`
keeps, per layer, `[slots, max_len, kv_heads, head_dim]` keys and values and speaks the one
method the models call —
Hugging Face attention and the built-in GPT's alike:

    keys, values = cache.update(key_states, value_states, layer_idx, ...)

Before each forward the caller says where the batch writes (`for_prefill` / `for_decode`); the
model's own forward does the rest, with a 4-D bool mask (`prefill_mask`, `decode_mask`) saying
which keys each query sees. A Hugging Face model returns a 4-D mask as it is, so no cache
bookkeeping (`get_seq_length`, mask sizes) is ever asked of this object.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SlotCache:
    def __init__(
        self,
        n_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        # Position-major rows, so that a write is one index_copy_ into the [slots * max_len, ...]
        # view: compiled, that stays an in-place write. An index_put_ at (row, position) pairs was
        # functionalised by inductor into a copy of the whole cache every step (7 ms of a 16 ms
        # step at 32 slots here).
        shape = (slots, max_len, kv_heads, head_dim)
        self.slots, self.max_len = slots, max_len
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        if device.type == "cuda":  # fixed addresses: a CUDA graph of the decode step reads them in place
            for t in (*self.keys, *self.values):
                torch._dynamo.mark_static_address(t)
        self._rows: Tensor | None = None
        self._flat: Tensor | None = None  # where the next forward writes, as rows of the flat view
        self._key_len = 0
        self._prefill = False

    def for_prefill(self, rows: Tensor, length: int) -> None:
        """The next forward is a prefill of `rows` (slot ids, [B]) from position 0 to `length`."""
        positions = torch.arange(length, device=rows.device)
        self._flat = (rows[:, None] * self.max_len + positions[None, :]).reshape(-1)
        self._prefill = True

    def for_decode(self, positions: Tensor, key_len: int, rows: Tensor | None = None) -> None:
        """The next forward decodes one token per row: slot rows[i] (default: every slot, in
        order) at positions[i]; attention reads keys [0, key_len)."""
        self._rows = rows
        if rows is None:
            rows = torch.arange(self.slots, device=positions.device)
        self._flat = rows * self.max_len + positions
        self._key_len = key_len
        self._prefill = False

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write [B, kv_heads, T, head_dim] keys/values at each row's positions; return what the
        attention reads: the batch's own (prefill starts at 0) or every slot up to key_len."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        B, H, T, D = key_states.shape
        k.view(-1, H, D).index_copy_(
            0, self._flat, key_states.transpose(1, 2).reshape(B * T, H, D).to(k.dtype)
        )
        v.view(-1, H, D).index_copy_(
            0, self._flat, value_states.transpose(1, 2).reshape(B * T, H, D).to(v.dtype)
        )
        if self._prefill:
            return key_states, value_states
        n, dtype = self._key_len, key_states.dtype
        k, v = k[:, :n], v[:, :n]
        if self._rows is not None:  # some slots only: gather theirs (the first n positions only)
            k, v = k.index_select(0, self._rows), v.index_select(0, self._rows)
        return k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)


def prefill_mask(batch: int, length: int, device: torch.device) -> Tensor:
    """[B, 1, length, length] causal mask. Right padding needs nothing more: a real token never
    sees the padding after it, and the padding's outputs are never read."""
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None])[None, None].expand(batch, 1, length, length)


def decode_mask(positions: Tensor, key_len: int) -> Tensor:
    """[S, 1, 1, key_len]: slot i sees its keys at positions <= positions[i]."""
    keys = torch.arange(key_len, device=positions.device)
    return (keys[None, :] <= positions[:, None])[:, None, None, :]


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as the additive float mask eager attention implementations add to scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
