"""From token sequences to device batches: overflow handling, collation, resumable iteration.

A sequence of n tokens gives n-1 training positions (input t, label t+1). How they are laid out is
the model's batch convention (slipstream.models): for the built-in GPT labels arrive already
shifted (an item of n positions fills n columns); for a model that shifts labels itself (Hugging
Face) the row holds all n tokens, labels equal the inputs, and each document's first token is
labelled -100 so that no position predicts across a document boundary. Either way real_tokens
counts predicted positions, so every convention is measured in the same unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..models.convention import SHIFTED, BatchConvention
from ..recipe import RecipeError, ShapesConfig
from .policy import BatchPlan, ShapePolicy, get_shape_policy

IGNORE_INDEX = -100


class Batch(dict):
    """Model keyword arguments (input_ids, labels, ...) plus host-side counts as attributes.

    The counts are computed on the host while collating, so reading them never syncs the device.
    """

    real_tokens: int
    padded_tokens: int
    shape: tuple[int, int]


@dataclass(frozen=True)
class OverflowReport:
    sequences: int
    """Sequences given."""
    empty: int
    """Sequences with fewer than 2 tokens (nothing to predict), skipped."""
    overflowed: int
    """Sequences longer than max_len + 1 tokens."""
    dropped_tokens: int
    """Training positions lost to truncation or dropping."""
    items: int
    """Items after overflow handling (split sequences count once per piece)."""


def _as_int_array(seq: object, index: int, vocab_size: int | None = None) -> np.ndarray:
    arr = seq.numpy() if isinstance(seq, torch.Tensor) else np.asarray(seq)
    if arr.ndim != 1:
        raise RecipeError(
            f"sequence {index} has shape {arr.shape}; each sequence must be a 1-D list of token ids"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise RecipeError(f"sequence {index} holds {arr.dtype} values; token ids must be integers")
    check_token_ids(arr, index, vocab_size)
    return arr


def check_token_ids(ids: np.ndarray, index: int | None, vocab_size: int | None) -> None:
    """Refuse ids an embedding cannot look up (negative, or >= vocab_size where it is known) here,
    naming the sequence, rather than as an IndexError inside the model's forward."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and (vocab_size is None or hi < vocab_size):
        return
    bad = lo if lo < 0 else hi
    at = int(np.flatnonzero(ids == bad)[0])
    allowed = f"in [0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else ">= 0"
    where = (
        f"sequence {index} holds token id {bad} at position {at}" if index is not None else f"token id {bad}"
    )
    raise RecipeError(f"{where}; token ids must be {allowed}: fix the tokenization of the data")


def make_items(
    sequences: Sequence,
    cfg: ShapesConfig,
    lengths: np.ndarray | None = None,
    vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, OverflowReport]:
    """Apply the overflow policy. Returns (item_seq, item_start, item_len, report) in positions.

    Without `lengths` every sequence is read once here, and its token ids are checked (>= 0, and
    < vocab_size when given); with `lengths` the ids are checked batch by batch as they are collated."""
    if lengths is None:
        lengths = np.array(
            [len(_as_int_array(s, i, vocab_size)) for i, s in enumerate(sequences)], dtype=np.int64
        )
    positions = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)
    if len(positions) == 0:
        raise RecipeError("the dataset is empty: give at least one sequence of 2 or more tokens")
    nonempty = positions > 0
    if not nonempty.any():
        raise RecipeError("every sequence has fewer than 2 tokens, so there is nothing to predict")
    over = positions > cfg.max_len
    if over.any() and cfg.overflow == "error":
        first = int(np.flatnonzero(over)[0])
        raise RecipeError(
            f"{int(over.sum())} sequences are longer than shapes.max_len={cfg.max_len} (first: #{first}, "
            f"{int(positions[first]) + 1} tokens); set shapes.overflow=truncate or split (or drop), or raise max_len"
        )
    seq_ids, starts, lens = [], [], []
    dropped = 0
    for i in np.flatnonzero(nonempty):
        n = int(positions[i])
        if n <= cfg.max_len:
            seq_ids.append(i), starts.append(0), lens.append(n)
        elif cfg.overflow == "drop":
            dropped += n
        elif cfg.overflow == "truncate":
            seq_ids.append(i), starts.append(0), lens.append(cfg.max_len)
            dropped += n - cfg.max_len
        else:  # split into max_len pieces; each piece is its own item
            for a in range(0, n, cfg.max_len):
                seq_ids.append(i), starts.append(a), lens.append(min(cfg.max_len, n - a))
    if not seq_ids:
        raise RecipeError(
            f"shapes.overflow=drop dropped all {int(over.sum())} sequences (all longer than "
            f"shapes.max_len={cfg.max_len}); raise max_len or use overflow=split"
        )
    report = OverflowReport(
        sequences=len(positions),
        empty=int((~nonempty).sum()),
        overflowed=int(over.sum()),
        dropped_tokens=dropped,
        items=len(seq_ids),
    )
    return np.array(seq_ids, np.int64), np.array(starts, np.int64), np.array(lens, np.int64), report


def collate(
    plan: BatchPlan,
    sequences: Sequence,
    item_seq: np.ndarray,
    item_start: np.ndarray,
    pad_id: int,
    with_documents: bool,
    convention: BatchConvention = SHIFTED,
) -> dict[str, np.ndarray]:
    """Arrays of one batch. Segments are in columns: positions for shifted labels, tokens otherwise."""
    B, T = plan.shape
    shifted = convention.labels_shifted
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((B, T), dtype=np.int64) if with_documents else None
    by_document_ids = with_documents and convention.packing == "document_ids"
    document_ids = np.full((B, T), -1, dtype=np.int64) if by_document_ids else None
    for r, row in enumerate(plan.rows):
        col = 0
        for d, seg in enumerate(row):
            seq = np.asarray(sequences[int(item_seq[seg.item])])
            a = int(item_start[seg.item]) + seg.start
            n = len(seg)
            input_ids[r, col : col + n] = seq[a : a + n]
            if shifted:
                labels[r, col : col + n] = seq[a + 1 : a + 1 + n]
            else:  # the model shifts: a document's first token is nobody's target
                labels[r, col + 1 : col + n] = seq[a + 1 : a + n]
            if with_documents:
                position_ids[r, col : col + n] = np.arange(n)
            if by_document_ids:
                document_ids[r, col : col + n] = d
            col += n
        if with_documents and col < T:
            # Padding forms its own "document" so it attends only to itself and never to real tokens.
            position_ids[r, col:] = np.arange(T - col)
            if by_document_ids:
                document_ids[r, col:] = len(row)
    out = {"input_ids": input_ids, "labels": labels}
    if with_documents:
        out["position_ids"] = position_ids
    if by_document_ids:
        out["document_ids"] = document_ids
    return out


class ShapedLoader:
    """Iterates one epoch of batches per `for` loop; resumable mid-epoch via state_dict()."""

    def __init__(
        self,
        sequences: Sequence,
        cfg: ShapesConfig,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        pad_id: int = 0,
        rank: int = 0,
        world_size: int = 1,
        lengths: np.ndarray | None = None,
        on_batch: Callable[[Batch, float], None] | None = None,
        convention: BatchConvention = SHIFTED,
        group: int | None = None,
        vocab_size: int | None = None,
    ):
        """`convention`: the model's batch convention (slipstream.models.detect_convention).
        `group`: consecutive batches planned with one shape (default `world_size`: each step's
        batches of all ranks); slipstream.distributed plans whole optimizer steps this way.
        `vocab_size`: the model's vocabulary, when known: ids (and pad_id) at or above it are refused."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if pad_id < 0 or (vocab_size is not None and pad_id >= vocab_size):
            vocab = f" and below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise RecipeError(f"pad_id={pad_id} must be a token id: >= 0{vocab}")
        self.vocab_size = vocab_size
        self.sequences = sequences
        self.cfg = cfg
        self.seed = seed
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.rank, self.world_size = rank, world_size
        self.convention = convention
        extra = convention.extra_column
        if extra and cfg.max_len <= extra:
            raise RecipeError(f"shapes.max_len={cfg.max_len} leaves no room for a prediction; raise it")
        # Items are cut in positions; a row needs `extra` more columns per item than it predicts.
        self.item_seq, self.item_start, item_len, self.overflow = make_items(
            sequences, replace(cfg, max_len=cfg.max_len - extra), lengths, vocab_size
        )
        self.policy: ShapePolicy = get_shape_policy(cfg.mode)(
            cfg, item_len + extra, world_size=group or world_size
        )
        self.epoch = 0
        self.position = 0
        self._on_batch = on_batch
        # Plan the first epoch now so bad settings (a budget below one row, ...) fail at construction.
        self._plans: list[BatchPlan] | None = self.plans()

    # -- planning -------------------------------------------------------------------------------

    def plans(self, epoch: int | None = None) -> list[BatchPlan]:
        """This rank's batch plans for an epoch (deterministic in seed and epoch)."""
        epoch = self.epoch if epoch is None else epoch
        rng = np.random.default_rng([self.seed, epoch])
        plans = self.policy.plan_epoch(rng)
        if self.world_size > 1:
            per_rank = len(plans) // self.world_size  # equal step counts on every rank
            plans = plans[self.rank : per_rank * self.world_size : self.world_size]
        return plans

    def __len__(self) -> int:
        return len(self.plans())

    def padding_waste(self, epoch: int = 0) -> float:
        """Fraction of batch positions that are padding over one epoch (no tensors built)."""
        total = real = 0
        for plan in self.plans(epoch):
            B, T = plan.shape
            total += B * T
            real += self.predicted_tokens(plan)
        return 1.0 - real / total if total else 0.0

    def predicted_tokens(self, plan: BatchPlan) -> int:
        """Positions of `plan` with a target: each segment's columns less the convention's extra one."""
        extra = self.convention.extra_column
        return sum(len(s) - extra for row in plan.rows for s in row)

    # -- iteration ------------------------------------------------------------------------------

    def make_batch(self, plan: BatchPlan) -> Batch:
        arrays = collate(
            plan,
            self.sequences,
            self.item_seq,
            self.item_start,
            self.pad_id,
            self.policy.uses_document_ids,
            self.convention,
        )
        self._check_batch_ids(plan, arrays["input_ids"], arrays["labels"])
        pin = self.device.type == "cuda"
        batch = Batch()
        for k, v in arrays.items():
            t = torch.from_numpy(v)
            if pin:
                t = t.pin_memory()
            batch[k] = t.to(self.device, non_blocking=pin)
        real = self.predicted_tokens(plan)
        batch.real_tokens = real
        batch.padded_tokens = plan.shape[0] * plan.shape[1] - real
        batch.shape = plan.shape
        return batch

    def _check_batch_ids(self, plan: BatchPlan, input_ids: np.ndarray, labels: np.ndarray) -> None:
        """A min and a max per batch; on a bad id, name its sequence (labels hold each segment's
        last token, which no input holds)."""
        targets = labels[labels != IGNORE_INDEX]
        lo = min(int(input_ids.min()), int(targets.min()) if targets.size else 0)
        hi = max(int(input_ids.max()), int(targets.max()) if targets.size else 0)
        if lo >= 0 and (self.vocab_size is None or hi < self.vocab_size):
            return
        for row in plan.rows:
            for seg in row:
                seq = int(self.item_seq[seg.item])
                check_token_ids(np.asarray(self.sequences[seq]), seq, self.vocab_size)
        check_token_ids(np.array([lo, hi]), None, self.vocab_size)  # not reached: a segment holds it

    def __iter__(self) -> Iterator[Batch]:
        if self._plans is None:
            self._plans = self.plans()
        while self.position < len(self._plans):
            t0 = time.perf_counter()
            # Named on the profiler timeline so `slipstream profile` can attribute data time.
            with torch.profiler.record_function("slipstream.data"):
                batch = self.make_batch(self._plans[self.position])
            self.position += 1
            if self._on_batch is not None:
                self._on_batch(batch, time.perf_counter() - t0)
            yield batch
        self.epoch += 1
        self.position = 0
        self._plans = None

    def forever(self) -> Iterator[Batch]:
        """Batches across epoch boundaries, for step-counted training loops."""
        while True:
            yield from self

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "items": len(self.item_seq),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed") != self.seed or state.get("items") != len(self.item_seq):
            raise RecipeError(
                "the checkpoint's data order does not match this dataset/seed "
                f"(checkpoint seed={state.get('seed')}, items={state.get('items')}; "
                f"now seed={self.seed}, items={len(self.item_seq)}); resume with the same data and recipe"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._plans = None
