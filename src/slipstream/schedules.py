"""Learning-rate schedules from `OptimizerConfig`: warm-up, then constant, cosine, linear or one-cycle.

Every schedule is a `torch.optim.lr_scheduler.LambdaLR` over one picklable multiplier, so a
checkpoint's scheduler state restores exactly. The curves are the ones torch's own schedulers draw
(CosineAnnealingLR, LinearLR, OneCycleLR with cycle_momentum=False); tests/test_schedules.py
checks them step by step. One multiplier instead of SequentialLR chains: SequentialLR re-steps its
children on load and its state does not survive a change of run length.

Step i (0-based) of the run uses lr * multiplier(i):

    warm-up (i < w):       (i + 1) / w                      (the same ramp Session used before)
    constant:              1
    cosine:                r + (1 - r) * (1 + cos(pi * p)) / 2,   p = (i - w) / (T - 1 - w)
    linear:                r + (1 - r) * (1 - p)
    one-cycle:             torch's OneCycleLR: cosine from 1/25 up to 1 over steps 0..w-1, then
                           cosine down to r at step T - 1 (w = 30% of T when warmup_steps = 0)

with w = warmup_steps, T = total steps of the run, r = final_lr_ratio. Past T the multiplier
holds its last value.
"""

from __future__ import annotations

import math

import torch

from .recipe import OptimizerConfig, RecipeError

SCHEDULES = ("constant", "cosine", "linear", "one-cycle")
ONE_CYCLE_START_RATIO = 1.0 / 25.0
"""one-cycle starts at lr / 25 (torch OneCycleLR's div_factor)."""
ONE_CYCLE_WARMUP_FRACTION = 0.3
"""one-cycle with warmup_steps=0 rises over this fraction of the run (torch's pct_start)."""


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


class LRMultiplier:
    """lr multiplier at step i; a plain object so LambdaLR saves and restores its fields."""

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int | None, final_ratio: float):
        if schedule not in SCHEDULES:
            raise RecipeError(f"optimizer.schedule={schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if schedule != "constant" and not total_steps:
            raise RecipeError(
                f"optimizer.schedule={schedule!r} decays over the run, so it needs the run's length: "
                "pass total_steps to build_scheduler (slipstream.train passes its steps)"
            )
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps) if total_steps else 0
        self.final_ratio = float(final_ratio)
        if schedule == "one-cycle" and self.warmup_steps == 0:
            self.warmup_steps = max(1, round(ONE_CYCLE_WARMUP_FRACTION * self.total_steps))
        if schedule != "constant" and self.warmup_steps >= self.total_steps:
            raise RecipeError(
                f"optimizer.warmup_steps={warmup_steps} leaves no steps to decay in a run of "
                f"{total_steps}; use fewer warm-up steps or optimizer.schedule=constant"
            )

    def __call__(self, step: int) -> float:
        w, T, r = self.warmup_steps, self.total_steps, self.final_ratio
        if self.schedule == "one-cycle":
            return self._one_cycle(min(step, T - 1))
        if step < w:
            return (step + 1) / w
        if self.schedule == "constant":
            return 1.0
        p = min(1.0, (step - w) / max(1, T - 1 - w))
        if self.schedule == "cosine":
            return r + (1.0 - r) * (1.0 + math.cos(math.pi * p)) / 2.0
        return r + (1.0 - r) * (1.0 - p)

    def _one_cycle(self, step: int) -> float:
        # OneCycleLR's two phases: [0, w-1] up, [w-1, T-1] down (phase ends as torch computes them).
        end_up, end_down = self.warmup_steps - 1, self.total_steps - 1
        if step <= end_up:
            pct = step / end_up if end_up > 0 else 1.0
            return _cos(ONE_CYCLE_START_RATIO, 1.0, pct)
        pct = (step - end_up) / max(1, end_down - end_up)
        return _cos(1.0, self.final_ratio, pct)


def lr_multiplier(cfg: OptimizerConfig, total_steps: int | None = None) -> LRMultiplier:
    return LRMultiplier(cfg.schedule, cfg.warmup_steps, total_steps, cfg.final_lr_ratio)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int | None = None
) -> torch.optim.lr_scheduler.LRScheduler:
    """The recipe's schedule over `optimizer`; call `.step()` once after every optimizer step.

    `total_steps` is the run's length; constant needs none, the decaying schedules need it."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, total_steps))


def lr_curve(cfg: OptimizerConfig, total_steps: int) -> list[float]:
    """The learning rate of every step of a run of `total_steps` (for plots and docs)."""
    f = lr_multiplier(cfg, total_steps)
    return [cfg.lr * f(i) for i in range(total_steps)]


__all__ = ["SCHEDULES", "LRMultiplier", "build_scheduler", "lr_curve", "lr_multiplier"]
