"""Load-balanced shards: rows per rank in proportion to each rank's measured speed.

Ranks that run at different speeds (a slower GPU, a shared CPU core, thermal throttling) make the
fast ones wait at every gradient all-reduce. Each rank times its own forwards (no collective runs
in a DDP forward, so this is its compute speed, not its wait) in seconds per token of each step.
Every `balance_every` steps the ranks exchange these per-step figures and compare them step by
step: all ranks ran the same row length at each step, so the per-step ratios cancel what the
steps differ in (bucket length, a hiccup every rank saw) and leave how fast each rank is. When the
ranks' median ratios differ by more than the ratios' own noise, twice in a row, later steps give
each rank rows in proportion to its (smoothed) speed (slipstream.distributed.shards). The loss
weighting keeps the update that of the equal split, so balancing changes the time of a step, not
what it learns.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from .env import DistEnv, gather_floats
from .shards import StepShards

# Speeds this close count as equal whatever the noise: moving a row or two would cost more (the
# batches leave their planned shapes) than it could save.
_MIN_SPREAD = 0.05
_WINDOWS_TO_TURN_ON = 2  # one odd window (a background job, a page-cache miss) is not a slow rank


class LoadBalancer:
    def __init__(self, shards: StepShards, env: DistEnv, mode: str, every: int, lead_steps: int):
        """`lead_steps`: a new split takes effect this many steps after it is agreed, beyond what
        a prefetcher may already have prepared with the old one."""
        self.shards, self.env, self.mode = shards, env, mode
        self.every, self.lead = every, lead_steps
        self.active = mode == "on"
        self._step_s = 0.0
        self._step_tokens = 0
        self._seconds: list[float] = []  # this rank's forward seconds, one per step
        self._tokens: list[int] = []  # ... and positions
        self._events: list[tuple[Any, Any, int]] = []  # CUDA (start, end, step index)
        self._votes = 0
        self._speeds: list[float] | None = None
        self.history: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def timed(self, rows: int, row_len: int, device: torch.device) -> Iterator[None]:
        """Time one micro-batch forward of `rows` x `row_len` positions on this rank."""
        if self.mode == "off" or not self.env.active:
            yield
            return
        self._step_tokens += rows * row_len
        if device.type == "cuda":  # events: timing must not add a host sync per step
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end, len(self._seconds)))
        else:
            t0 = time.perf_counter()
            yield
            self._step_s += time.perf_counter() - t0

    def after_step(self, global_step: int) -> None:
        """Called by every rank after each optimizer step (every `every` steps: a collective)."""
        if self.mode == "off" or not self.env.active:
            return
        self._seconds.append(self._step_s)
        self._tokens.append(max(self._step_tokens, 1))
        self._step_s, self._step_tokens = 0.0, 0
        if global_step % self.every:
            return
        for start, end, i in self._events:
            self._seconds[i] += start.elapsed_time(end) / 1e3
        self._events.clear()
        window = [s / n for s, n in zip(self._seconds, self._tokens)][-self.every :]
        self._seconds, self._tokens = [], []
        by_rank = gather_floats(window, self.env)
        self._decide(by_rank, global_step)

    def _decide(self, by_rank: list[list[float]], global_step: int) -> None:
        ratios = [[] for _ in by_rank]  # each rank's time at a step / the ranks' mean at that step
        for at_step in zip(*by_rank):
            mean = sum(at_step) / len(at_step)
            if mean > 0:
                for r, t in enumerate(at_step):
                    ratios[r].append(t / mean)
        if not ratios[0]:
            return
        rel = [statistics.median(r) for r in ratios]
        noise = max(statistics.median(abs(x - m) for x in r) for r, m in zip(ratios, rel))
        spread = max(rel) / min(rel) - 1
        uneven = spread > max(_MIN_SPREAD, 3 * noise)
        self._votes = self._votes + 1 if uneven else 0
        if not self.active and self._votes >= _WINDOWS_TO_TURN_ON:
            self.active = True
        entry: dict[str, Any] = {
            "step": global_step,
            "relative_time": [round(x, 4) for x in rel],
            "spread": round(spread, 4),
            "noise": round(noise, 4),
        }
        if self.active:
            speeds = [1.0 / x for x in rel]
            if self._speeds is not None:  # smoothed: one window's noise must not swing the split
                speeds = [0.5 * a + 0.5 * b for a, b in zip(self._speeds, speeds)]
            self._speeds = speeds
            shares = [s / sum(speeds) for s in speeds]
            equal = 1 / len(shares)
            if max(abs(s - equal) for s in shares) < _MIN_SPREAD * equal / 2:
                shares = None  # as good as equal: keep the planned batches and their shapes
            self.shards.set_shares(shares, from_step=global_step + self.lead)
            entry.update(shares=shares and [round(s, 4) for s in shares], from_step=global_step + self.lead)
        self.history.append(entry)

    def describe(self) -> dict[str, Any]:
        return {
            "balance_mode": self.mode,
            "balance_active": self.active,
            "balance_history": self.history[-20:],
        }
