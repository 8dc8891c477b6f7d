"""Load-balanced shards: rows per rank in proportion to each rank's measured speed.

Ranks that run at different speeds (a slower GPU, a shared CPU core, thermal throttling) make the
fast ones wait at every gradient all-reduce. Each rank times its own forward per row (no
collective runs in a DDP forward, so this is its compute speed, not its wait); every
`balance_every` steps the ranks exchange their medians and their step-to-step noise, and when the
speeds differ by more than the noise the next steps give each rank rows in proportion to its
speed (slipstream.distributed.shards). The loss weighting keeps the update that of the equal
split, so balancing changes the time of a step, not what it learns.
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

# Speeds this close are treated as equal even when the noise is lower (rows are whole numbers).
_MIN_SPREAD = 0.05


class LoadBalancer:
    def __init__(self, shards: StepShards, env: DistEnv, mode: str, every: int, lead_steps: int):
        """`lead_steps`: a new split takes effect this many steps after it is agreed, beyond what
        a prefetcher may already have prepared with the old one."""
        self.shards, self.env, self.mode = shards, env, mode
        self.every, self.lead = every, lead_steps
        self.active = mode == "on"
        self._s_per_row: list[float] = []
        self._pending: list[tuple[Any, Any, int]] = []  # CUDA events read at the next exchange
        self.history: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def timed(self, rows: int, device: torch.device) -> Iterator[None]:
        """Time one micro-batch forward of `rows` rows on this rank."""
        if self.mode == "off" or not self.env.active:
            yield
            return
        if device.type == "cuda":  # events: timing must not add a host sync per step
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end, rows))
        else:
            t0 = time.perf_counter()
            yield
            self._record(time.perf_counter() - t0, rows)

    def _record(self, seconds: float, rows: int) -> None:
        self._s_per_row.append(seconds / max(rows, 1))

    def after_step(self, global_step: int) -> None:
        """Called by every rank after each optimizer step (the exchange is a collective)."""
        if self.mode == "off" or not self.env.active or global_step % self.every:
            return
        for start, end, rows in self._pending:
            self._record(start.elapsed_time(end) / 1e3, rows)
        self._pending.clear()
        window = self._s_per_row[-self.every :] or [0.0]
        self._s_per_row.clear()
        median = statistics.median(window)
        noise = statistics.median(abs(x - median) for x in window)
        ranks = gather_floats([median, noise], self.env)
        medians = [m for m, _ in ranks]
        if min(medians) <= 0:
            return
        spread = max(medians) / min(medians) - 1
        noisiest = max(n / m for m, n in ranks)
        if not self.active and spread > max(_MIN_SPREAD, 3 * noisiest):
            self.active = True  # auto: speeds differ by more than each rank's own noise
        entry: dict[str, Any] = {
            "step": global_step,
            "s_per_row": [round(m, 6) for m in medians],
            "spread": round(spread, 4),
            "noise": round(noisiest, 4),
        }
        if self.active:
            speeds = [1.0 / m for m in medians]
            shares = [s / sum(speeds) for s in speeds]
            self.shards.set_shares(shares, from_step=global_step + self.lead)
            entry.update(shares=[round(s, 4) for s in shares], from_step=global_step + self.lead)
        self.history.append(entry)

    def describe(self) -> dict[str, Any]:
        return {
            "balance_mode": self.mode,
            "balance_active": self.active,
            "balance_history": self.history[-20:],
        }
