"""Packing: several documents per fixed-length row, so nearly every position is a real token.

Rows are max_len long; the model gets position_ids that restart at 0 for each document and
document_ids that keep attention inside a document (block-diagonal causal), and labels never cross
a boundary because each document's labels are its own shifted tokens (see loader.collate). Items
are at most max_len long: longer documents were split, truncated or dropped by shapes.overflow.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from .policy import BatchPlan, Segment, ShapePolicy, register_shape_policy, rows_per_batch


def pack_best_fit_decreasing(
    lengths: np.ndarray, order: np.ndarray, capacity: int, window: int
) -> list[list[int]]:
    """Rows of item indices: each window of `order`, longest first, goes into the fullest row it fits.

    Best-fit keeps a sorted list of the open rows' free space, so each placement is a bisect:
    O(n log n) per window. Rows do not carry across windows (a window is planned on its own, which
    bounds memory and keeps the result independent of what comes later).
    """
    rows: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = order[w : w + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        free: list[tuple[int, int]] = []  # (free positions, row index), ascending
        for item in chunk.tolist():
            n = int(lengths[item])
            k = bisect_left(free, (n, -1))
            if k < len(free):
                space, r = free.pop(k)
            else:
                space, r = capacity, len(rows)
                rows.append([])
            rows[r].append(item)
            if space - n > 0:
                insort(free, (space - n, r))
    return rows


def pack_greedy(lengths: np.ndarray, order: np.ndarray, capacity: int) -> list[list[int]]:
    """Streaming next-fit: documents in order; a row closes when the next document does not fit."""
    rows: list[list[int]] = []
    used = capacity  # forces a new row for the first item
    for item in order.tolist():
        n = int(lengths[item])
        if used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(item)
        used += n
    return rows


@register_shape_policy("pack")
class PackPolicy(ShapePolicy):
    """Documents packed into max_len rows; B = tokens_per_batch // max_len rows per batch."""

    uses_document_ids = True

    def __init__(self, cfg, lengths, world_size: int = 1):
        super().__init__(cfg, lengths, world_size)
        self.rows_per_batch = rows_per_batch(cfg, cfg.max_len)
        self.packed_rows = 0

    def pack(self, order: np.ndarray) -> list[list[int]]:
        if self.cfg.pack_algorithm == "greedy":
            return pack_greedy(self.lengths, order, self.cfg.max_len)
        return pack_best_fit_decreasing(self.lengths, order, self.cfg.max_len, self.cfg.pack_window)

    def plan_epoch(self, rng: np.random.Generator) -> list[BatchPlan]:
        rows = self.pack(rng.permutation(len(self.lengths)))
        self.packed_rows = len(rows)
        # BFD emits rows longest-documents-first; shuffle rows so batches mix document lengths.
        rows = [rows[i] for i in rng.permutation(len(rows))]
        b, T = self.rows_per_batch, self.cfg.max_len
        plans = []
        for i in range(0, len(rows), b):
            chunk = [tuple(Segment(j, 0, int(self.lengths[j])) for j in row) for row in rows[i : i + b]]
            chunk += [()] * (b - len(chunk))  # all-padding rows keep B static
            plans.append(BatchPlan(T, tuple(chunk)))
        return plans

    def describe(self) -> dict[str, object]:
        return {
            "pack_algorithm": self.cfg.pack_algorithm,
            "packed_rows": self.packed_rows,
            "documents_per_row": len(self.lengths) / max(self.packed_rows, 1),
        }
