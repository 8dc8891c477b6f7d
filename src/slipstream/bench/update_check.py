"""The update check: does a contender in another precision move the weights the way the reference does?

A precision change (bf16 autocast, fp16 with loss scaling, pure bf16 weights) keeps the reference's
batches, so the precision band judges it (slipstream.bench.precision_band). Where that precision's
own arithmetic is chaotic the band cannot resolve 1%: on the built-in GPT small (host B, default
budget) two bf16 re-runs that differ only in the order of rows in each batch end 0.2-1.5% apart,
and both bf16 autocast and pure bf16 weights, a planted fault, stay "unjudged" (docs/bench.md).

Chaos is a property of many steps; one step is not chaotic. So the check starts the reference and
the contender from the same point, the reference's final weights and optimizer state, and lets each
take `UPDATE_STEPS` optimizer steps on window 0's batches (the same batches, each side's own
precision, loss scaling and clipping; the learning rate each group started at, without the
schedule). Per parameter tensor the contender's weight change is compared with the reference's:
||d_c - d_r|| / ||d_r||. The statistic is the median over the tensors the reference moved: a few
tensors whose gradient is noise by construction (a key bias, which softmax ignores) stay out of it.

Rounding noise in the gradient moves a step's update a little; weights that cannot hold the update
lose it: in bf16 a weight near 1 has a spacing of 2^-7, so an Adam step of lr 1e-3 does not move it.
Measured on host B (AMD Zen 4, CPU, 2026-12-06; benchmarks/parity_update_probe.py, then bench's
own rows in benchmarks/parity_power.py runs, docs/bench.md method 5): after 100 fp32 steps, one
step's median tensor error is ~6e-7 for fp32 with the rows permuted; in bench, 0.14-0.51% for bf16
autocast and 11.7-23.8% for pure bf16 over GPT tiny (20 seeds), HF Llama tiny (20) and GPT small
(20; seed 19 on an Intel Xeon with AMX-BF16, 2026-12-07). After 8 steps (the probe) autocast is
0.45-0.50% and pure bf16 9-11%: more steps separate them less, so the check takes one.

A failed check fails the contender: its steps do not do what the reference's do. A passed check
vouches for a plain recipe that changes precision alone when its precision band leaves it
unjudged: each of its steps is the reference's step up to rounding, so its final loss is one draw
of its precision's own spread, which the band measured. A fail of the band itself stands.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..recipe import Recipe

UPDATE_STEPS = 1
"""Optimizer steps each side takes from the reference's final state (window 0's first batches)."""

UPDATE_TOLERANCE = 0.02
"""Median relative error of a tensor's weight change allowed: 4x the largest bf16 autocast error
measured (0.51%), 5.8x below the smallest pure bf16 one (11.7%)."""


@dataclass(frozen=True)
class UpdateCheck:
    errors: dict[str, float]
    """Per parameter tensor the reference moved: ||d_c - d_r|| / ||d_r||."""
    tolerance: float = UPDATE_TOLERANCE

    @property
    def median(self) -> float:
        return statistics.median(self.errors.values()) if self.errors else math.nan

    @property
    def passed(self) -> bool:
        return self.median <= self.tolerance  # NaN (no tensor moved) is not a pass

    def worst(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.errors.items(), key=lambda kv: -kv[1])[:n]

    def to_dict(self) -> dict[str, Any]:
        median = self.median
        return {
            "median_error": median if math.isfinite(median) else None,
            "tensors": len(self.errors),
            "worst": [[name, err] for name, err in self.worst()],
            "tolerance": self.tolerance,
            "passed": self.passed,
        }


def update_errors(
    updates: dict[str, torch.Tensor], reference_updates: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per tensor the reference moved: the relative error of the contender's weight change."""
    out = {}
    for name, ref in reference_updates.items():
        norm = float(ref.norm())
        if norm == 0.0 or name not in updates:
            continue  # a tensor the reference did not move (frozen, no gradient) says nothing
        out[name] = float((updates[name] - ref).norm()) / norm
    return out


def host_copy(obj: Any) -> Any:
    """`obj` (a state dict: nested dicts and lists of tensors and numbers) with every tensor copied
    to host memory: a copy of a model's optimizer state beside it could not fit a GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


@dataclass(frozen=True)
class ReferenceStep:
    """The reference's side of the check, taken once per benchmark: its final state (host copies),
    the batches both sides step on, and its own weight change over them."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    batches: list
    updates: dict[str, torch.Tensor]

    @classmethod
    def take(cls, reference) -> ReferenceStep:
        """Step `reference` (a RecipeContender, after its validation) from a copy of its final state,
        then give it that state back: the batching check reads its final weights after this."""
        model_state = host_copy(reference.eager_module.state_dict())
        optimizer_state = host_copy(reference.optimizer.state_dict())
        batches = [b for b, _ in reference.window_batches(raw=True)][:UPDATE_STEPS]
        updates = reference.step_updates(model_state, optimizer_state, batches)
        reference.load_state(model_state, optimizer_state)
        return cls(model_state, optimizer_state, batches, updates)

    def check(self, contender) -> dict[str, Any]:
        """The check's row for `contender` (a RecipeContender, after its validation and batching
        check: its weights and optimizer state are replaced): `UpdateCheck.to_dict()`, or `skipped`
        with why it could not run (parameters that are not the reference's)."""
        try:
            updates = contender.step_updates(self.model_state, self.optimizer_state, self.batches)
        except (RuntimeError, KeyError, ValueError) as err:
            return {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        return UpdateCheck(update_errors(updates, self.updates)).to_dict()


def failure_note(name: str, precision: str, row: dict[str, Any]) -> str:
    """The warning for a failed check's row."""
    worst = ", ".join(f"{n} {e:.0%}" for n, e in row["worst"])
    return (
        f"{name}: parity fail: from the reference's final weights and optimizer state, its {precision} "
        f"steps change the weights {row['median_error']:.1%} off the reference's (median over "
        f"{row['tensors']} tensors; > {row['tolerance']:.1%}; worst: {worst}): updates lost to rounding "
        "(weights kept in a low precision), or gradients that under/overflow"
    )


def precision_only(base: Recipe, recipe: Recipe) -> bool:
    """Whether `recipe` differs from `base` in its `precision` section alone."""
    return replace(recipe, name=base.name, precision=base.precision) == base


def vouch(verdict: str, row: dict[str, Any] | None, changes_precision_only: bool) -> str:
    """The verdict of a plain recipe that changes precision alone and whose update check passed: its
    precision band's "unjudged" becomes "pass". A fail stands."""
    if verdict == "unjudged" and changes_precision_only and row is not None and row.get("passed") is True:
        return "pass"
    return verdict


__all__ = [
    "UPDATE_STEPS",
    "UPDATE_TOLERANCE",
    "ReferenceStep",
    "UpdateCheck",
    "failure_note",
    "host_copy",
    "precision_only",
    "update_errors",
    "vouch",
]
