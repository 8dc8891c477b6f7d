"""What every contender in a benchmark is: the interface the runner drives (Contender, LoopContender),
the stats of a round, the device sync that ends a timed region, the token-matched loader that
gives every contender the same real tokens per step, and the document windows that pair every
contender's data with the reference's (DocumentWindows, WindowedLoader)."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..shapes.loader import Batch


@dataclass
class RoundStats:
    seconds: float
    real_tokens: int
    padded_tokens: int
    steps: int
    data_wait_s: float
    losses: list[float]


class Contender(ABC):
    """One thing being measured. Subclasses own their model, optimizer and data."""

    name: str
    kind = "recipe"
    precision = "fp32"

    @abstractmethod
    def run_round(
        self, real_token_budget: int | None, max_steps: int | None = None, max_seconds: float | None = None
    ) -> RoundStats:
        """Train until `real_token_budget` real tokens (or `max_steps` steps) are consumed, or
        `max_seconds` have passed (a round is never cut before its first step)."""

    @abstractmethod
    def validation_loss(self) -> float:
        """Token-weighted validation loss on the batches shared by every contender."""

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Release what the contender holds beyond its objects (threads, processes); called once."""
        return None


class LoopContender(Contender):
    """A contender whose loop we drive: one `train_step` per batch from `self.batches`."""

    batches: Iterator[Batch]
    device: torch.device
    shapes_seen: set[tuple[int, int]]

    @abstractmethod
    def train_step(self, batch: Batch) -> torch.Tensor:
        """Forward and backward of `batch` (scaled by its `weight`, where it has one), then the
        optimizer step where the batch ends one (`step_end`, default True); returns the batch's own
        mean loss (left on the device)."""

    def data_wait_since(self, mark: int) -> float:
        """Seconds spent waiting for data since `round_mark()` returned `mark`."""
        return 0.0

    def round_mark(self) -> int:
        return 0

    def run_round(
        self, real_token_budget: int | None, max_steps: int | None = None, max_seconds: float | None = None
    ) -> RoundStats:
        """A batch with `step_end` False is a micro-batch: its loss counts with its `weight` (its
        share of the step's targets) and the step ends with the batch whose `step_end` is True (a
        paired window grouped into the reference's steps, WindowedLoader). A round never ends
        inside a step."""
        real = padded = steps = 0
        losses: list[torch.Tensor] = []  # kept on the device until the round ends: no sync per step
        step_loss: torch.Tensor | None = None
        mark = self.round_mark()
        sync_device(self.device)
        t0 = time.perf_counter()
        while step_loss is not None or (
            (real_token_budget is None or real < real_token_budget)
            and (max_steps is None or steps < max_steps)
            and (max_seconds is None or steps == 0 or time.perf_counter() - t0 < max_seconds)
        ):
            batch = next(self.batches)
            self.shapes_seen.add(batch.shape)
            part = self.train_step(batch).detach()
            weight = getattr(batch, "weight", 1.0)
            if weight != 1.0:  # a micro-batch: no extra kernel for a whole-step batch
                part = part * weight
            step_loss = part if step_loss is None else step_loss + part
            real += batch.real_tokens
            padded += batch.padded_tokens
            if getattr(batch, "step_end", True):
                losses.append(step_loss)
                step_loss = None
                steps += 1
        sync_device(self.device)
        return RoundStats(
            seconds=time.perf_counter() - t0,
            real_tokens=real,
            padded_tokens=padded,
            steps=steps,
            data_wait_s=self.data_wait_since(mark),
            losses=torch.stack(losses).float().tolist() if losses else [],
        )


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def real_tokens_per_step(loader) -> float:
    """Mean real tokens per batch over the loader's first epoch (plans only, no tensors)."""
    plans = loader.plans(epoch=0)
    # predicted positions, in whatever columns the model's batch convention lays them out
    real = sum(loader.predicted_tokens(plan) for plan in plans)
    return real / max(len(plans), 1)


MATCH_TOLERANCE = 0.05
"""Real tokens per step may differ from the reference's by this fraction before the token budget
per batch is rescaled."""


def matched_loader(
    build: Callable[[int | None], Any],
    tokens_per_batch: int,
    target: float | None,
    min_tokens: int = 1,
    *,
    fits: Callable[[Any], bool] | None = None,
):
    """A loader whose batches carry `target` real tokens on average (within MATCH_TOLERANCE).

    Shape policies pad differently, so the same positions per batch hold different real tokens per
    optimizer step; comparing them as is would compare different training (fewer, fuller steps).
    The budget is rescaled by the measured ratio and the loader rebuilt, at most three times; it never
    goes below `min_tokens` (one full row), so a tiny target may stay above it. `fits`: a condition
    the loader must meet (a paired contender: every window holds at least as many of its batches as
    the reference has steps there); where the matched loader does not, the largest budget that does
    is found by bisection (fewer tokens per batch, more batches)."""
    loader = build(None)
    if target is None:
        return loader
    have = real_tokens_per_step(loader)
    best = (abs(have - target), tokens_per_batch, loader)
    for _ in range(3):
        if abs(have - target) <= MATCH_TOLERANCE * target:
            break
        scaled = max(min_tokens, round(tokens_per_batch * target / have))
        if scaled == tokens_per_batch:
            break
        tokens_per_batch = scaled
        loader = build(tokens_per_batch)
        have = real_tokens_per_step(loader)
        best = min(best, (abs(have - target), tokens_per_batch, loader), key=lambda b: b[0])
    if best[0] > MATCH_TOLERANCE * target:
        # whole rows make the figure jump (pack: 4 or 5 rows of max_len); try a row either side
        for tpb in (best[1] - min_tokens, best[1] + min_tokens):
            if tpb >= min_tokens:
                cand = build(tpb)
                best = min(best, (abs(real_tokens_per_step(cand) - target), tpb, cand), key=lambda b: b[0])
    if fits is None or fits(best[2]):
        return best[2]
    lo, hi, found = min_tokens, best[1], None  # fewer tokens per batch: more batches per window
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        cand = build(mid)
        if fits(cand):
            lo, found = mid, cand
        else:
            hi = mid
    return found if found is not None else build(min_tokens)


def step_ends(tokens: list[int], steps: int) -> list[bool]:
    """Group consecutive batches (their real tokens in `tokens`) into `steps` optimizer steps of
    near-equal real tokens: per batch, whether it ends a step. Every step gets at least one batch,
    so with fewer batches than `steps` each batch is a step of its own."""
    n = len(tokens)
    k = min(steps, n)
    if k <= 0:
        return [True] * n
    cum = np.cumsum(np.asarray(tokens, dtype=np.float64))
    ends, last = [], -1
    for j in range(1, k):
        lo, hi = last + 1, n - 1 - (k - j)  # leave at least one batch for each later step
        target = j * cum[-1] / k
        last = lo + int(np.argmin(np.abs(cum[lo : hi + 1] - target)))
        ends.append(last)
    flags = [False] * n
    for e in [*ends, n - 1]:
        flags[e] = True
    return flags


class DocumentWindows:
    """The documents a paired run consumes, window by window, the same for every contender.

    The corpus is shuffled once with the data seed (a new permutation each epoch) and cut into
    consecutive windows of about `window_tokens` training positions (each document counted at most
    `max_len`). Every contender trains on window 0, then window 1, ...: a shape policy decides how
    a window's documents are batched and in which order, never which documents a step range sees.
    `order(w, order_seed)` is window w's documents; order_seed 0 keeps the shuffled order, another
    seed permutes them inside the window (the null re-runs' only difference from the reference)."""

    def __init__(self, lengths: np.ndarray, max_len: int, window_tokens: int, seed: int):
        if window_tokens < 1:
            raise ValueError(f"window_tokens={window_tokens} must be >= 1")
        self.positions = np.minimum(np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0), max_len)
        self.window_tokens = window_tokens
        self.seed = seed
        self._windows: list[np.ndarray] = []
        self._epoch = 0
        self._lock = threading.Lock()  # contenders' prefetch threads ask for windows concurrently

    def _cut_epoch(self) -> None:
        order = np.random.default_rng([self.seed, self._epoch]).permutation(len(self.positions))
        order = order[self.positions[order] > 0]
        ends = np.cumsum(self.positions[order])
        cuts = np.searchsorted(ends, np.arange(self.window_tokens, ends[-1], self.window_tokens), "right")
        self._windows += [w for w in np.split(order, cuts + 1) if len(w)]
        self._epoch += 1

    def order(self, w: int, order_seed: int = 0) -> np.ndarray:
        with self._lock:  # two threads cutting the same epoch would append its windows twice
            while len(self._windows) <= w:
                self._cut_epoch()
            docs = self._windows[w]
        if order_seed:
            docs = np.random.default_rng([self.seed, order_seed, w]).permutation(docs)
        return docs


class WindowedLoader:
    """One contender's loader over DocumentWindows: window w's documents batched by the contender's
    own shape policy (`build(sequences, lengths)`, a ShapedLoader over just those documents), one
    epoch of it, then window w + 1. `plans(epoch=0)` are the first `plan_windows` windows' (what
    matched_loader measures real tokens per step on)."""

    def __init__(
        self,
        build: Callable[[list, np.ndarray], Any],
        sequences,
        lengths: np.ndarray,
        windows: DocumentWindows,
        *,
        order_seed: int = 0,
        plan_windows: int = 4,
        steps_per_window: Callable[[int], int] | None = None,
    ):
        self.build, self.sequences, self.lengths = build, sequences, np.asarray(lengths)
        self.windows, self.order_seed, self.plan_windows = windows, order_seed, plan_windows
        self.steps_per_window = steps_per_window
        self.short_windows = 0
        """Windows with fewer batches than the reference's steps (each batch then a step of its own)."""
        self._cache: dict[int, Any] = {}
        self._cache_lock = threading.Lock()  # the reference's is also read from other prefetch threads
        self.first = self.window_loader(0)  # fails here on a bad shape setting, like a ShapedLoader

    def window_loader(self, w: int):
        with self._cache_lock:
            if w not in self._cache:
                docs = self.windows.order(w, self.order_seed)
                self._cache = {k: v for k, v in self._cache.items() if k >= w - 1}  # keep memory flat
                self._cache[w] = self.build([self.sequences[int(i)] for i in docs], self.lengths[docs])
            return self._cache[w]

    def plans(self, epoch: int = 0) -> list:
        return [p for w in range(self.plan_windows) for p in self.window_loader(w).plans(epoch=0)]

    def predicted_tokens(self, plan) -> int:
        return self.first.predicted_tokens(plan)

    def __getattr__(self, name: str) -> Any:  # cfg, policy, convention, ...: the first window's
        if name == "first":
            raise AttributeError(name)
        return getattr(self.first, name)

    def forever(self) -> Iterator[Batch]:
        """Window after window. With `steps_per_window` (the reference's step count of each window),
        a window's batches are grouped into that many optimizer steps (micro-batches with `weight`
        and `step_end`): every paired contender then trains each window's documents in the
        reference's number of steps, whatever its shape policy's batch count, so after any step
        count all of them have consumed the same windows."""
        w = 0
        while True:
            loader = self.window_loader(w)
            if self.steps_per_window is None:
                yield from loader
            else:
                tokens = [self.predicted_tokens(p) for p in loader.plans(epoch=0)]
                wanted = self.steps_per_window(w)
                self.short_windows += len(tokens) < wanted
                ends = step_ends(tokens, wanted)
                step_of = np.cumsum([0, *ends[:-1]])  # each batch's step within the window
                totals = np.bincount(step_of, weights=tokens)[step_of]  # so weights sum to 1 per step
                for batch, end, t, total in zip(loader, ends, tokens, totals):
                    batch.step_end, batch.weight = end, t / max(float(total), 1.0)
                    yield batch
            w += 1
