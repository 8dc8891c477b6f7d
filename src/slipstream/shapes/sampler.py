"""Token-budget batches from planned length buckets: a handful of (B, T) shapes, steady memory.

Each batch holds items of one bucket only, padded to the bucket's edge T, with B = tokens_per_batch
// T rows, so every batch spends about the same memory and there are at most k shapes to compile.

Distributed: the epoch is planned identically on every rank (same seed), as groups of world_size
consecutive batches of one bucket; ShapedLoader hands rank r the r-th batch of each group. So every
rank sees a disjoint shard and, at every step, the same shape as the others (no rank waits on a
recompile the others do not need). Items left over after a bucket's whole batches (whole groups
of world_size batches when distributed) move up to the next bucket when that pads less than
all-padding rows would (always when distributed); the longest bucket's incomplete group, at most
world_size - 1 batches, is left out of that epoch (shuffling changes which items, each epoch).
"""

from __future__ import annotations

import numpy as np

from ..recipe import ShapesConfig
from .planner import BucketPlan, plan_buckets
from .policy import BatchPlan, ShapePolicy, register_shape_policy, rows_per_batch, single_segment_rows


@register_shape_policy("bucket")
class BucketPolicy(ShapePolicy):
    """Pad each item to its planned bucket's length; one bucket per batch, B = tokens_per_batch // T."""

    def __init__(self, cfg: ShapesConfig, lengths: np.ndarray, world_size: int = 1):
        super().__init__(cfg, lengths, world_size)
        self.buckets: BucketPlan = plan_buckets(
            self.lengths,
            cfg.buckets,
            max_len=cfg.max_len,
            multiple_of=cfg.multiple_of,
            shape_cost_tokens=cfg.shape_cost_tokens,
        )
        self.bucket_of = self.buckets.assign(self.lengths)
        # Fails here, naming the field and the longest bucket, when the budget cannot hold one row.
        self.rows = [rows_per_batch(cfg, edge) for edge in reversed(self.buckets.edges)][::-1]
        self.dropped_batches = 0

    def plan_epoch(self, rng: np.random.Generator) -> list[BatchPlan]:
        ws, edges = self.world_size, self.buckets.edges
        groups: list[list[BatchPlan]] = []
        dropped = 0
        carried = np.zeros(0, dtype=np.int64)
        for b, edge in enumerate(edges):
            items = rng.permutation(np.concatenate([carried, np.flatnonzero(self.bucket_of == b)]))
            B = self.rows[b]
            whole = len(items) // (ws * B) * (ws * B)
            rest = len(items) - whole
            carried = np.zeros(0, dtype=np.int64)
            if rest and b + 1 < len(edges) and self._promote(rest, B, edge, edges[b + 1]):
                # The tail that cannot fill a whole batch (group) moves up one bucket instead of
                # riding with all-padding rows: costs edge' - edge per item rather than whole rows.
                items, carried = items[:whole], items[whole:]
            batches = [BatchPlan(edge, tuple(rows)) for rows in single_segment_rows(items, self.lengths, B)]
            keep = len(batches) // ws * ws
            dropped += len(batches) - keep
            groups += [batches[i : i + ws] for i in range(0, keep, ws)]
        self.dropped_batches = dropped
        # Shuffle whole groups, so buckets interleave over the epoch while ranks stay in lock-step.
        return [plan for g in rng.permutation(len(groups)) for plan in groups[g]]

    def _promote(self, rest: int, B: int, edge: int, next_edge: int) -> bool:
        if self.world_size > 1:
            return True  # otherwise the tail would be dropped from the epoch
        empty_rows_cost = (-rest % B) * edge
        return rest * (next_edge - edge) < empty_rows_cost

    def describe(self) -> dict[str, object]:
        return {
            "bucket_edges": list(self.buckets.edges),
            "bucket_counts": list(self.buckets.counts),
            "bucket_rows_per_batch": list(self.rows),
            "bucket_expected_waste": self.buckets.expected_waste,
            "bucket_dropped_batches": self.dropped_batches,
        }
