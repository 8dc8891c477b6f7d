"""Each rank's share of every optimizer step, cut from one epoch plan that all ranks compute alike.

The epoch is planned identically on every rank (same seed) in groups of `batches_per_step`
batches of one shape (the bucket policy groups them), so at each step every rank runs the same
row length: no rank waits on another's longer bucket. A step's rows are split between ranks by
`shares` (equal by default; the load balancer moves rows to faster ranks), and each rank's rows
are cut into `batches_per_step / world_size` micro-batches that it accumulates.

Every micro-batch carries `weight` = its targets / the whole step's targets, known on every rank
from the plan without communication. Scaling each micro-batch's mean loss by it makes the summed
gradient that of the token-weighted mean over the global batch, however the rows were split: the
update of a balanced step equals the equal-split update, and equals one process accumulating the
same batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from ..recipe import RecipeError
from ..shapes.loader import Batch, ShapedLoader
from ..shapes.policy import BatchPlan


def split_rows(total: int, shares: list[float], minimum: int) -> list[int]:
    """Rows per rank: proportional to `shares`, at least `minimum` each, summing to `total`
    (largest remainders get the leftover rows)."""
    n = len(shares)
    if total < minimum * n:
        raise RecipeError(f"a step of {total} rows cannot give {n} ranks {minimum} rows each")
    weights = np.asarray(shares, dtype=np.float64)
    weights = weights / weights.sum()
    spare = total - minimum * n
    exact = weights * spare
    rows = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - rows), kind="stable")[: spare - int(rows.sum())]:
        rows[i] += 1
    return [int(r) + minimum for r in rows]


class StepShards:
    """Micro-batches of this rank, step after step, with `weight`, `step_end` and `step_rows` set."""

    def __init__(self, loader: ShapedLoader, *, batches_per_step: int, rank: int, world_size: int):
        if batches_per_step % world_size:
            raise RecipeError(
                f"distributed.batches_per_step={batches_per_step} must be a multiple of the "
                f"world size {world_size}; use 0 (one batch per rank) or a multiple"
            )
        if loader.world_size != 1:
            raise ValueError("StepShards shards the whole plan itself: build the loader with world_size=1")
        self.loader = loader
        self.batches_per_step = batches_per_step
        self.rank, self.world_size = rank, world_size
        self.accumulate = batches_per_step // world_size
        self.epoch = 0
        self.step = 0  # the next step within the epoch
        self._shares: list[tuple[int, list[float] | None]] = []  # (from global step, shares), ascending
        self.global_step = 0
        self._steps = self._group(self.epoch)
        if not self._steps:
            raise RecipeError(
                f"one epoch plans fewer than distributed.batches_per_step={batches_per_step} batches; "
                "lower batches_per_step or shapes.tokens_per_batch, or give more data"
            )

    @property
    def cfg(self):
        return self.loader.cfg

    @property
    def policy(self):
        return self.loader.policy

    @property
    def overflow(self):
        return self.loader.overflow

    def _group(self, epoch: int) -> list[list[BatchPlan]]:
        plans = self.loader.plans(epoch)
        n = self.batches_per_step
        return [plans[i : i + n] for i in range(0, len(plans) // n * n, n)]

    def steps_per_epoch(self) -> int:
        return len(self._steps)

    # -- shares -------------------------------------------------------------------------------------

    def set_shares(self, shares: list[float] | None, from_step: int) -> None:
        """Split steps >= `from_step` (global) in proportion to `shares` (one per rank; None: the
        equal split of whole planned batches). Every rank must make the same call: the split is
        not communicated."""
        if shares is not None and (len(shares) != self.world_size or min(shares) <= 0):
            raise ValueError(f"shares {shares} must be {self.world_size} positive numbers")
        kept = [(s, v) for s, v in self._shares if s < from_step]
        self._shares = kept + [(from_step, None if shares is None else list(shares))]

    def shares_at(self, global_step: int) -> list[float] | None:
        current: list[float] | None = None
        for start, shares in self._shares:
            if start <= global_step:
                current = shares
        return current

    def split(self, group: list[BatchPlan], global_step: int) -> list[BatchPlan]:
        """This rank's micro-batch plans of one step."""
        k, r = self.accumulate, self.rank
        shares = self.shares_at(global_step)
        same_len = len({p.row_len for p in group}) == 1
        if shares is None or not same_len:
            return group[r * k : (r + 1) * k]  # equal split: this rank's own whole batches
        rows = [row for plan in group for row in plan.rows]
        counts = split_rows(len(rows), shares, minimum=k)
        start = sum(counts[:r])
        mine = rows[start : start + counts[r]]
        cuts = np.linspace(0, len(mine), k + 1).round().astype(int)
        T = group[0].row_len
        return [BatchPlan(T, tuple(mine[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]

    # -- iteration ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        loader = self.loader
        while self.step < len(self._steps):
            group = self._steps[self.step]
            targets = sum(loader.predicted_tokens(p) for p in group)
            plans = self.split(group, self.global_step)
            step_rows = [p.shape[0] for p in plans]
            for i, plan in enumerate(plans):
                t0 = time.perf_counter()
                with torch.profiler.record_function("slipstream.data"):
                    batch = loader.make_batch(plan)
                batch.weight = batch.real_tokens / max(targets, 1)
                batch.step_targets = targets
                batch.step_end = i == len(plans) - 1
                batch.step_rows = sum(step_rows)
                if batch.step_end:  # the state a checkpoint after this step resumes from
                    self.step += 1
                    self.global_step += 1
                if loader._on_batch is not None:
                    loader._on_batch(batch, time.perf_counter() - t0)
                yield batch
        self.epoch += 1
        self.step = 0
        self._steps = self._group(self.epoch)

    def forever(self) -> Iterator[Batch]:
        while True:
            yield from self

    def state_dict(self) -> dict[str, int]:
        state = self.loader.state_dict()
        state.update(
            epoch=self.epoch,
            position=self.step * self.batches_per_step,
            global_step=self.global_step,
            batches_per_step=self.batches_per_step,
        )
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
        saved = int(state.get("batches_per_step", 1))
        if saved != self.batches_per_step:
            raise RecipeError(
                f"the checkpoint was written with {saved} batches per step and this run has "
                f"{self.batches_per_step}; set distributed.batches_per_step={saved} to resume it "
                "(it is world-size independent: 2 ranks x 1 = 1 rank accumulating 2)"
            )
        self.epoch = int(state["epoch"])
        self.step = int(state["position"]) // self.batches_per_step
        self.global_step = int(state.get("global_step", 0))
        self._steps = self._group(self.epoch)
