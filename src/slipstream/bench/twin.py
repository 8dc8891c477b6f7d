"""The numerics twin: a verdict for a recipe that changes batching and numerics together.

`auto` or `bucket+bf16` batch the reference's documents another way *and* compute in another way.
Against the reference only the order band can judge such a recipe, and at 100 steps that band seldom
resolves 1% (docs/bench.md: 1 seed of 20 on HF Llama tiny). Its two changes can be judged apart:

- its **twin** is the same recipe on the reference's `shapes` and `dataflow`: the reference's batches,
  the recipe's numerics. It trains beside the others and is judged against the reference on the
  numerics band and the curve check, which resolve 0.2%;
- the recipe itself then differs from its twin in batching alone, which its batching check judges
  (the reference's documents and final weights, batched both ways, in the recipe's precision).

Both passing, the recipe passes ("twin+check"). A twin that fails fails the recipe: its numerics
alone change the training. A fail of the order band itself always stands. Custom contenders (the
planted faults) get no twin: their code is not a recipe.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..recipe import Recipe
from .batching_check import batching_only


def twin_recipe(reference: Recipe, recipe: Recipe) -> Recipe | None:
    """`recipe` on the reference's shapes and dataflow, or None where no twin is needed (the same
    batches already, or a change of batching alone) or none can share the reference's batches (the
    reference's shapes are `auto`, decided per session)."""
    if reference.shapes.mode == "auto" or batching_only(reference, recipe):
        return None
    if recipe.shapes == reference.shapes:
        return None
    return replace(recipe, name=f"{recipe.name} (twin)", shapes=reference.shapes, dataflow=reference.dataflow)


def judge_with_twin(verdict: str, check: dict[str, Any] | None, twin: dict[str, Any]) -> str:
    """A composite recipe's verdict from its own order-band `verdict`, its batching `check` row and its
    `twin` row (`verdict`: the twin's own, numerics band and curve check). A detected difference
    stands; a twin that fails fails it; both passing pass it; anything else leaves it as it was."""
    if verdict == "fail":
        return "fail"
    if twin.get("verdict") == "fail":
        return "fail"
    if twin.get("verdict") == "pass" and check is not None and check.get("passed") is True:
        return "pass"
    return verdict


__all__ = ["judge_with_twin", "twin_recipe"]
