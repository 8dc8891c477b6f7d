"""The model side of generation: prefill and one-token decode through the model's own forward over
a preallocated `kv.SlotCache`, with prompt lengths and key lengths rounded to a few shapes
(`generate.py` schedules requests onto it)."""

from __future__ import annotations

import torch
from torch import Tensor

from .kv import SlotCache, decode_mask, prefill_mask
from .model import LoadedModel

KEY_MULTIPLE = 128


def round_up(n: int, m: int, cap: int) -> int:
    return min(cap, -(-n // m) * m)


class Decoder:
    """Prefill and one-token decode through the model's own forward over a SlotCache."""

    def __init__(
        self, loaded: LoadedModel, slots: int, dtype: torch.dtype = torch.float32, compile: bool = False
    ):
        kv = loaded.kv
        self.loaded = loaded
        self.slots = slots
        self.max_len = loaded.max_len
        self.device = next(loaded.model.parameters()).device
        self.cache = SlotCache(
            kv.n_layers, slots, kv.kv_heads, loaded.max_len, kv.head_dim, self.device, dtype
        )
        self.prefill_multiple = 64 if self.device.type == "cuda" else 16
        if compile:
            # On CUDA, inductor records a CUDA graph per compiled shape (one per key bucket).
            options = {"triton.cudagraphs": True} if self.device.type == "cuda" else {}
            self._decode = torch.compile(self._decode_impl, dynamic=False, options=options)
        else:
            self._decode = self._decode_impl

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> Tensor:
        """Fill each slot's cache with its prompt; logits [n, vocab] of the token after each."""
        n = len(prompts)
        P = round_up(max(len(p) for p in prompts), self.prefill_multiple, self.max_len)
        ids = torch.full((n, P), self.loaded.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        self.cache.for_prefill(torch.as_tensor(slots, device=self.device), P)
        positions = torch.arange(P, device=self.device).expand(n, P)
        last = torch.as_tensor([len(p) - 1 for p in prompts], device=self.device)
        mask = prefill_mask(n, P, self.device)
        return self.loaded.cached_logits(self.loaded.model, ids, positions, self.cache, mask, last)

    def _decode_impl(
        self, tokens: Tensor, positions: Tensor, key_len: int, rows: Tensor | None = None
    ) -> Tensor:
        self.cache.for_decode(positions, key_len, rows)
        mask = decode_mask(positions, key_len)
        logits = self.loaded.cached_logits(
            self.loaded.model, tokens[:, None], positions[:, None], self.cache, mask, None
        )
        return logits[:, -1]

    @torch.inference_mode()
    def decode_one_token(self, tokens: Tensor, positions: Tensor, rows: Tensor | None = None) -> Tensor:
        """tokens, positions: [slots] (or [len(rows)] for the slots `rows` only: eager code gains
        nothing from computing idle slots); logits [rows, vocab] of each one's next token."""
        key_len = self.key_len_for(int(positions.max()) + 1)
        if rows is None:
            return self._decode(tokens, positions, key_len)
        return self._decode_impl(tokens, positions, key_len, rows)

    def key_len_for(self, n: int) -> int:
        return round_up(n, KEY_MULTIPLE, self.max_len)

    def key_buckets(self, up_to: int) -> list[int]:
        """Every key length a decode step over positions < up_to can attend to."""
        return sorted({self.key_len_for(n) for n in range(1, up_to + 1)})
