"""The static shapes a server runs, and how a set of waiting requests is cut into batches.

Every forward pass runs one of a small planned set of (batch, length) shapes, so each shape is
warmed (and compiled / graph-captured where that applies) once before the server says ready, and
its latency is *measured*, not guessed. Lengths come from `slipstream.shapes.planner` (exact
min-padding buckets over a length histogram, e.g. the validation split); batch sizes are powers of
two up to `max_batch_size`, capped per length by a token budget so long rows do not blow latency.

`partition` cuts the requests the batcher has collected into batches: sorted by length, split into
contiguous runs, each run padded to its (batch, length) shape, minimising the summed measured
latency of the shapes (an O(n^2) DP over at most a few dozen requests). This replaces a fixed
"pad everything to the longest" rule: one 1000-token request no longer drags 15 short ones along.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ..recipe import RecipeError


def ewma(old: float | None, new: float, alpha: float = 0.2) -> float:
    """Exponentially weighted moving average; the first observation starts it."""
    return new if old is None else (1 - alpha) * old + alpha * new


def _pow2_upto(n: int) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    out.append(n)
    return out


@dataclass
class ShapePlan:
    lengths: tuple[int, ...]
    """Row lengths (ascending); a request goes to the first length >= its token count."""
    batch_sizes: dict[int, tuple[int, ...]]
    """Allowed batch sizes per row length (ascending)."""
    latency_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """Measured seconds per forward of each (batch, length) shape; filled by warm-up, then an EWMA."""

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(b, L) for L in self.lengths for b in self.batch_sizes[L]]

    @property
    def max_len(self) -> int:
        return self.lengths[-1]

    def length_for(self, n: int) -> int:
        i = bisect.bisect_left(self.lengths, n)
        if i == len(self.lengths):
            raise ValueError(f"length {n} exceeds the largest planned length {self.lengths[-1]}")
        return self.lengths[i]

    def batch_for(self, n: int, length: int) -> int | None:
        """Smallest planned batch size >= n for this row length, or None if n does not fit."""
        sizes = self.batch_sizes[length]
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def predict(self, b: int, length: int) -> float:
        """Measured latency of a shape; before warm-up, a token-proportional placeholder."""
        return self.latency_s.get((b, length), 1e-6 * b * length)

    def observe(self, b: int, length: int, seconds: float, alpha: float = 0.2) -> None:
        self.latency_s[(b, length)] = ewma(self.latency_s.get((b, length)), seconds, alpha)

    def seconds_per_token(self, length: int | None = None) -> float:
        """Best measured cost (seconds per padded token) over the shapes of this row length, or
        over all shapes. Per length, because a long row costs more per token (attention)."""
        costs = [t / (b * L) for (b, L), t in self.latency_s.items() if length in (None, L)]
        return min(costs) if costs else 1e-6


def plan_shapes(
    lengths: np.ndarray | list[int],
    *,
    max_len: int,
    n_lengths: int = 8,
    max_batch_size: int = 16,
    max_batch_tokens: int = 8192,
    multiple_of: int = 16,
    every_batch_size: bool = False,
) -> ShapePlan:
    """Length buckets from a histogram of expected request lengths (clipped to max_len) + batch sizes.

    The largest bucket is always max_len so that every admissible request has a shape. Batch
    sizes are powers of two (few shapes: each is a CUDA graph, and a GPU's cost is flat in rows),
    or with `every_batch_size` every size up to the cap (a CPU's cost is linear in rows, so a
    padded row is pure waste there, and one more warmed shape costs only its warm-up).
    """
    from ..shapes.planner import plan_buckets

    if max_batch_size < 1 or max_batch_tokens < 1 or n_lengths < 1:
        raise RecipeError("max_batch_size, max_batch_tokens and n_lengths must all be >= 1")
    arr = np.clip(np.asarray(lengths, dtype=np.int64), 1, max_len)
    if arr.size == 0:
        arr = np.array([max_len])
    # One bucket is reserved for max_len itself; plan the rest over the histogram.
    edges = set(plan_buckets(arr, max(1, n_lengths - 1), max_len=max_len, multiple_of=multiple_of).edges)
    edges.add(max_len)
    ordered = tuple(sorted(edges))
    caps = {L: max(1, min(max_batch_size, max_batch_tokens // L)) for L in ordered}
    sizes = {
        L: tuple(range(1, cap + 1)) if every_batch_size else tuple(_pow2_upto(cap)) for L, cap in caps.items()
    }
    return ShapePlan(lengths=ordered, batch_sizes=sizes)


def partition(lengths: list[int], plan: ShapePlan) -> list[tuple[list[int], int, int]]:
    """Cut requests (by index) into batches minimising summed predicted latency.

    Returns [(indices, batch_size, row_length)], each batch a run of the length-sorted requests.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut: list[tuple[int, int, int]] = [(0, 0, 0)] * (n + 1)
    for j in range(1, n + 1):
        L = plan.length_for(lengths[order[j - 1]])  # the run i..j-1 is padded to its longest
        for i in range(j - 1, -1, -1):
            b = plan.batch_for(j - i, L)
            if b is None:
                break  # longer runs at this length do not fit either
            cost = best[i] + plan.predict(b, L)
            if cost < best[j]:
                best[j], cut[j] = cost, (i, b, L)
    out = []
    j = n
    while j > 0:
        i, b, L = cut[j]
        out.append(([order[k] for k in range(i, j)], b, L))
        j = i
    return out[::-1]
