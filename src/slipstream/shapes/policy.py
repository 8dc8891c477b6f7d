"""Shape policies: how variable-length items are grouped into fixed (batch, length) tensors.

A policy sees only item lengths and plans one epoch as a list of `BatchPlan`s: the row length and,
for each row, which segments fill it. Collation is shared (`collate.py`), so a new policy (bucket,
pack) is one class registered by name; Session never changes. `bucket` lives in sampler.py and
`pack` in packing.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..recipe import RecipeError, ShapesConfig


@dataclass(frozen=True)
class Segment:
    """Positions [start, stop) of item `item` (an index into the items the policy was given)."""

    item: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BatchPlan:
    row_len: int
    """T of this batch: every row is padded to it."""
    rows: tuple[tuple[Segment, ...], ...]
    """One tuple of segments per row; an empty tuple is an all-padding row (keeps B static)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), self.row_len)


class ShapePolicy(ABC):
    """Plans batches for one epoch from item lengths. Subclasses are registered by name."""

    name: str = ""
    uses_document_ids: bool = False
    """True when rows hold several documents, so the model must mask attention across them."""

    def __init__(self, cfg: ShapesConfig, lengths: np.ndarray, world_size: int = 1):
        self.cfg = cfg
        # Ranks sharing one epoch plan (the loader gives rank r every world_size-th batch), so a
        # policy can group batches to give all ranks the same shape at each step (see bucket).
        self.world_size = world_size
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise RecipeError("the dataset is empty: give at least one non-empty sequence")
        if self.lengths.max() > cfg.max_len:
            raise ValueError("items longer than max_len must be handled by the overflow policy first")

    @abstractmethod
    def plan_epoch(self, rng: np.random.Generator) -> list[BatchPlan]:
        """All batches of one epoch, in order, using `rng` for any shuffling."""

    def describe(self) -> dict[str, object]:
        """Policy-specific facts for metrics (planned shapes, bucket edges, ...)."""
        return {}


SHAPE_POLICIES: dict[str, type[ShapePolicy]] = {}


def register_shape_policy(name: str) -> Callable[[type[ShapePolicy]], type[ShapePolicy]]:
    def decorator(cls: type[ShapePolicy]) -> type[ShapePolicy]:
        if name in SHAPE_POLICIES:
            raise ValueError(f"shape policy {name!r} is already registered")
        cls.name = name
        SHAPE_POLICIES[name] = cls
        return cls

    return decorator


def get_shape_policy(name: str) -> type[ShapePolicy]:
    if name not in SHAPE_POLICIES:
        raise RecipeError(
            f"shapes.mode={name!r} has no implementation here; available: {', '.join(sorted(SHAPE_POLICIES))}"
        )
    return SHAPE_POLICIES[name]


def rows_per_batch(cfg: ShapesConfig, row_len: int) -> int:
    """Largest B with B * row_len <= tokens_per_batch."""
    b = cfg.tokens_per_batch // row_len
    if b < 1:
        raise RecipeError(
            f"shapes.tokens_per_batch={cfg.tokens_per_batch} is smaller than one row of {row_len} tokens; "
            f"raise it to at least {row_len} or lower shapes.max_len"
        )
    return b


def single_segment_rows(order: np.ndarray, lengths: np.ndarray, b: int) -> list[list[tuple[Segment, ...]]]:
    """Items in `order`, one per row, b rows per batch; the last batch is filled with empty rows."""
    batches = []
    for i in range(0, len(order), b):
        chunk = order[i : i + b]
        rows = [(Segment(int(j), 0, int(lengths[j])),) for j in chunk]
        rows += [()] * (b - len(rows))  # all-padding rows keep the batch shape static
        batches.append(rows)
    return batches


@register_shape_policy("pad_max")
class PadToMax(ShapePolicy):
    """Every row padded to max_len: one shape, and the most padding."""

    def plan_epoch(self, rng: np.random.Generator) -> list[BatchPlan]:
        b = rows_per_batch(self.cfg, self.cfg.max_len)
        order = rng.permutation(len(self.lengths))
        return [
            BatchPlan(self.cfg.max_len, tuple(rows)) for rows in single_segment_rows(order, self.lengths, b)
        ]


@register_shape_policy("pad_batch")
class PadToBatchLongest(ShapePolicy):
    """Same batches as pad_max, each padded to its own longest row: less padding, many shapes."""

    def plan_epoch(self, rng: np.random.Generator) -> list[BatchPlan]:
        b = rows_per_batch(self.cfg, self.cfg.max_len)
        order = rng.permutation(len(self.lengths))
        plans = []
        for rows in single_segment_rows(order, self.lengths, b):
            longest = max((len(r[0]) for r in rows if r), default=1)
            plans.append(BatchPlan(longest, tuple(rows)))
        return plans
