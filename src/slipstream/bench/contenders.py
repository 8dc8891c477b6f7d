"""What every contender in a benchmark is: the interface the runner drives (Contender, LoopContender),
the stats of a round, the device sync that ends a timed region, and the token-matched loader that
gives every contender the same real tokens per step."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
        """One optimizer step on `batch`; returns the loss (left on the device)."""

    def data_wait_since(self, mark: int) -> float:
        """Seconds spent waiting for data since `round_mark()` returned `mark`."""
        return 0.0

    def round_mark(self) -> int:
        return 0

    def run_round(
        self, real_token_budget: int | None, max_steps: int | None = None, max_seconds: float | None = None
    ) -> RoundStats:
        real = padded = steps = 0
        losses: list[torch.Tensor] = []  # kept on the device until the round ends: no sync per step
        mark = self.round_mark()
        sync_device(self.device)
        t0 = time.perf_counter()
        while (
            (real_token_budget is None or real < real_token_budget)
            and (max_steps is None or steps < max_steps)
            and (max_seconds is None or steps == 0 or time.perf_counter() - t0 < max_seconds)
        ):
            batch = next(self.batches)
            self.shapes_seen.add(batch.shape)
            losses.append(self.train_step(batch).detach())
            real += batch.real_tokens
            padded += batch.padded_tokens
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
    build: Callable[[int | None], Any], tokens_per_batch: int, target: float | None, min_tokens: int = 1
):
    """A loader whose batches carry `target` real tokens on average (within MATCH_TOLERANCE).

    Shape policies pad differently, so the same positions per batch hold different real tokens per
    optimizer step; comparing them as is would compare different training (fewer, fuller steps).
    The budget is rescaled by the measured ratio and the loader rebuilt, at most three times; it never
    goes below `min_tokens` (one full row), so a tiny target may stay above it."""
    loader = build(None)
    if target is None:
        return loader
    for _ in range(3):
        have = real_tokens_per_step(loader)
        if abs(have - target) <= MATCH_TOLERANCE * target:
            break
        scaled = max(min_tokens, round(tokens_per_batch * target / have))
        if scaled == tokens_per_batch:
            break
        tokens_per_batch = scaled
        loader = build(tokens_per_batch)
    return loader
