"""The curve check: does a contender on the reference's batches train the way the reference does?

A change that keeps the reference's batches (bf16 autocast, a fused optimizer, kernels, compile, or
a learning rate) sees the same documents in the same steps, so its training loss is paired with the
reference's at every step. A harmless change moves that curve by rounding only. A change of the
optimization can move it a lot on the way and still land on the same validation loss: on the
built-in GPT tiny (host B, seed 0) lr x 3 ended 0.02% from the reference's validation loss after 102
steps, inside the 0.2% numerics band, while at step 16 its loss was 20% lower (docs/bench.md,
method 6). The final loss alone calls that "the same"; the curve does not.

The statistic is the mean training loss over the timed steps; its band is the spread of the same
statistic over the numerics null re-runs (the reference with the rows of each batch permuted), with
the parity floor, through `slipstream.parity.null_band`. Only a fail counts: the check can fail a
contender, never pass one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..parity import NullBand, gap_words, relative_gap


def curve_source(null_source: str) -> str:
    """The curve band's source, from the source of the re-runs it is measured over."""
    return f"mean training loss over the timed steps, {null_source}"


CURVE_SOURCE = curve_source("the reference re-run with the rows of each batch permuted")


def mean_train_loss(step_losses: Sequence[float]) -> float:
    """The curve's statistic: the mean of its per-step training losses (NaN without a step)."""
    return math.fsum(step_losses) / len(step_losses) if step_losses else math.nan


def check_curve(mean: float, reference_mean: float, band: NullBand) -> dict[str, Any]:
    """The check's row: both means, their relative gap, the band's threshold and `passed`."""
    gap = relative_gap(mean, reference_mean)
    return {
        "mean_train_loss": mean if math.isfinite(mean) else None,
        "reference": reference_mean if math.isfinite(reference_mean) else None,
        "gap": gap if math.isfinite(gap) else None,
        "tolerance": band.threshold,
        "passed": gap <= band.threshold,
    }


def failure_note(name: str, row: dict[str, Any]) -> str:
    """The warning for a failed check's row."""
    return (
        f"{name}: parity fail: on the reference's batches its training loss averages {gap_words(row['gap'])} off the "
        f"reference's, step for step (> {row['tolerance']:.2%}, the numerics re-runs' band): it trains "
        "differently (a learning rate, a schedule, a frozen layer), whatever its final validation loss"
    )


__all__ = ["curve_source", "CURVE_SOURCE", "check_curve", "failure_note", "mean_train_loss"]
