"""GPU-sized batches: ``shapes.batch_search=auto`` picks tokens per batch by measurement on CUDA.

On the first H200 run a user's 88M Llama trained at a CPU-sized ~1,400 real tokens per optimizer
step and left the GPU >= 96% idle (2.0% MFU): every step was launch- and host-bound, which even
made bf16 lose to fp32. So on CUDA, when the user has not pinned ``shapes.tokens_per_batch``, the
session times a training step (forward + backward on the user's own batches) at doubling token
budgets and stops at the first of:

- the knee: a doubling gained less than ``KNEE_GAIN`` in tokens/s (the smaller size is kept);
- memory: the step's peak allocation passed ``MEMORY_HEADROOM`` of the device (the smaller is kept);
- an out-of-memory error (the smaller is kept);
- ``MAX_TOKENS``.

The choice and the table of trials are the recorded reason. On a CPU nothing is searched: the
2-core hosts this project measures on are compute-bound at the default budget already.
The search is pure arithmetic over a ``measure(tokens) -> (tokens_per_s, peak_bytes)`` callable,
so tests feed it measurements.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

KNEE_GAIN = 1.10
"""A doubling of tokens per batch is kept only if it raises tokens/s by at least this factor."""

MEMORY_HEADROOM = 0.85
"""Largest share of the device's memory a trial step may peak at (the rest: optimizer state
growth, fragmentation, the allocator's caching)."""

MAX_TOKENS = 1 << 20
"""Never search past this many tokens per batch."""


def searches_batch(cfg, device: torch.device) -> bool:
    """Whether tokens per batch is searched: `shapes.batch_search=auto` on CUDA with
    `shapes.tokens_per_batch` at its default (a size the user pinned is theirs)."""
    from .recipe import ShapesConfig

    default = ShapesConfig.__dataclass_fields__["tokens_per_batch"].default
    return cfg.batch_search == "auto" and device.type == "cuda" and cfg.tokens_per_batch == default


class OutOfMemory(RuntimeError):
    """A trial step did not fit (raised by measure functions; torch's OOM is caught as well)."""


@dataclass(frozen=True)
class BatchTrial:
    tokens: int
    tokens_per_s: float | None
    peak_bytes: int | None
    note: str = ""

    def line(self) -> str:
        if self.tokens_per_s is None:
            return f"{self.tokens}: {self.note}"
        mem = f", peak {self.peak_bytes / 2**30:.1f} GiB" if self.peak_bytes else ""
        return f"{self.tokens}: {self.tokens_per_s:,.0f} tok/s{mem}"


@dataclass(frozen=True)
class BatchChoice:
    tokens: int
    why: str
    trials: tuple[BatchTrial, ...]

    @property
    def reason(self) -> str:
        return f"{self.why}; trials " + "; ".join(t.line() for t in self.trials)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, (OutOfMemory, torch.cuda.OutOfMemoryError)) or "out of memory" in str(err)


def find_knee(
    measure: Callable[[int], tuple[float, int | None]],
    start: int,
    *,
    memory_bytes: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> BatchChoice:
    """Double tokens per batch from ``start`` while it pays (see the module docstring)."""
    trials: list[BatchTrial] = []
    best, best_tps = None, None
    tokens = start
    why = f"reached the search limit of {max_tokens} tokens"
    while tokens <= max_tokens:
        try:
            tps, peak = measure(tokens)
        except Exception as err:
            if not _is_oom(err):
                raise
            trials.append(BatchTrial(tokens, None, None, "out of memory"))
            why = f"{tokens} tokens ran out of memory"
            break
        trials.append(BatchTrial(tokens, tps, peak))
        if memory_bytes and peak and peak > MEMORY_HEADROOM * memory_bytes:
            why = f"{tokens} tokens peaked above {MEMORY_HEADROOM:.0%} of the device's memory"
            break
        if best_tps is not None and tps < KNEE_GAIN * best_tps:
            why = f"the knee: doubling to {tokens} gained {tps / best_tps:.2f}x (< {KNEE_GAIN:.2f}x)"
            break
        best, best_tps = tokens, tps
        tokens *= 2
    if best is None:  # even the starting size failed: keep it, the first step will say why
        return BatchChoice(start, f"{why}: kept the starting {start}", tuple(trials))
    return BatchChoice(best, f"{best} tokens per batch: {why}", tuple(trials))


def step_timer(
    model: torch.nn.Module,
    batches_at: Callable[[int], Iterable[dict[str, torch.Tensor]]],
    autocast: Callable,
    device: torch.device,
    loss_of: Callable,
    *,
    steps: int = 3,
) -> Callable[[int], tuple[float, int | None]]:
    """A ``measure`` for ``find_knee`` on CUDA: forward + backward of a few of the user's own batches
    at each size (after one warm-up step), real tokens/s and the peak allocation."""

    def measure(tokens: int) -> tuple[float, int | None]:
        batches = list(itertools.islice(batches_at(tokens), steps + 1))  # one warm-up + `steps`
        if not batches:
            raise ValueError(f"no batch at {tokens} tokens per batch")
        torch.cuda.reset_peak_memory_stats(device)
        real = 0
        elapsed = 0.0
        for i, batch in enumerate(batches):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast():
                loss = loss_of(model(**batch))
            loss.backward()
            torch.cuda.synchronize(device)
            if i or len(batches) == 1:  # the first step allocates: not timed
                elapsed += time.perf_counter() - t0
                real += int((batch["labels"] != -100).sum())
        model.zero_grad(set_to_none=True)
        return real / elapsed, int(torch.cuda.max_memory_allocated(device))

    return measure
