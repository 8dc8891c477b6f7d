"""The precision band: the null for a contender that computes in another precision than the reference.

The numerics band's re-run permutes the rows of each batch in the reference's own precision. In fp32
that perturbs the loss by ~1e-7, and 100 steps do not amplify it: its spread is ~1e-7 and the 0.2%
floor rules. A bf16 run is another matter on some models. Measured on host B (AMD Zen 4, CPU,
2026-12-06), built-in GPT small at the default budget, seed 1: bf16 autocast with the same rows
permuted ended **1.54%** from bf16 autocast unpermuted, while the fp32 pair ended 1e-7 apart. Every
bf16 rounding turns a 1e-7 difference into a 4e-3 one, so a bf16 run there is one draw from a spread
of ~1%, and harmless bf16 failed the fp32 numerics band in 2 of 3 seeds (docs/bench.md). A 20-step
learning-rate warm-up does not make it stable: the two bf16 re-runs of seed 1 ended +0.44% and
+0.04% from fp32 with `optimizer.warmup_steps=20`. On GPT tiny and HF Llama tiny the same change
stayed within 0.022% over 20 seeds.

So a same-batch contender in precision `p` (bf16, fp16) is judged on the spread of the reference
re-run *in p* with the rows of each batch permuted: runs that differ from the reference only in what
a harmless change of precision perturbs. Two re-runs (df 2, t = 9.92) keep the band at the floor
where p's arithmetic is stable (spread ~1e-4: threshold ~0.14%) and widen it where it is not (spread
~1%: "unjudged", not a false fail); one re-run (t = 63.66) would not do: 63.66 x the 20 bf16 gaps measured
on HF Llama tiny (0-0.022%) passes the 1% resolution in 3 of them, so a single re-run drawn like
them would leave about 3 seeds of 20 unjudged (arithmetic on those gaps, not a run of this design).
"""

from __future__ import annotations

from dataclasses import replace

from ..parity import NullBand
from ..recipe import Recipe

DEFAULT_PRECISION_SEEDS = 2
"""Re-runs per precision that needs a band (see the module's docstring for why two)."""


def precision_source(precision: str) -> str:
    return (
        f"the reference re-run in {precision} with the rows of each batch permuted (same init, same batches)"
    )


def precisions_to_null(reference_precision: str, judged: list[str]) -> list[str]:
    """The precisions of same-batch contenders (and twins), `judged`, that need their own band:
    every one but the reference's, once each."""
    return sorted({p for p in judged if p != reference_precision})


def null_recipe(reference: Recipe, precision: str) -> Recipe:
    """The reference recipe computing in `precision` (its batches, optimizer and kernels unchanged)."""
    return replace(
        reference,
        name=f"{reference.name} (in {precision})",
        precision=replace(reference.precision, dtype=precision),  # type: ignore[arg-type]
    )


def unjudged_note(name: str, precision: str, band: NullBand) -> str:
    """The words for a contender its precision's band leaves unjudged."""
    return (
        f"{name}: parity unjudged: the reference re-run in {precision} moved the loss by itself "
        f"(sigma {band.sigma:.2%}), so this run would catch >= {band.detectable:.1%}, not a "
        f"{band.resolution:.0%} regression; more --precision-seeds shrink its t factor, not that spread"
    )


__all__ = [
    "DEFAULT_PRECISION_SEEDS",
    "null_recipe",
    "precision_source",
    "precisions_to_null",
    "unjudged_note",
]
