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

OWN = ("shapes.", "dataflow.")
"""Decision fields a twin makes for itself: it batches and delivers the reference's way."""


def twin_recipe(reference: Recipe, recipe: Recipe) -> Recipe | None:
    """`recipe` on the reference's shapes and dataflow, or None where no twin is needed (the same
    batches already, or a change of batching alone) or none can share the reference's batches (the
    reference's shapes are `auto`, decided per session)."""
    if (
        reference.shapes.mode == "auto"
        or recipe.shapes == reference.shapes
        or batching_only(reference, recipe)
    ):
        return None
    return replace(recipe, name=f"{recipe.name} (twin)", shapes=reference.shapes, dataflow=reference.dataflow)


def adopted_decisions(decisions: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The recipe's decisions (`Session.decisions`) its twin's Session starts with (its `decisions=`,
    as a resumed run's) instead of deciding again: every one but batching and delivery. A kernel timed
    at the twin's shapes could win by another candidate, and the twin would not compute like the
    recipe; adopted, precision, kernels, compile and optimizer are the recipe's by construction."""
    return {
        field: {"choice": d["choice"], "reason": f"adopted from the recipe it twins: {d['reason']}"}
        for field, d in decisions.items()
        if not field.startswith(OWN)
    }


def mismatch(decisions: dict[str, dict[str, str]], twin_decisions: dict[str, dict[str, str]]) -> list[str]:
    """`field: recipe's choice vs twin's` for each decision outside shapes and dataflow that the twin
    made otherwise (one its Session decides again despite `adopted_decisions`, or decides only for
    the twin). Such a twin does not compute like the recipe, so it cannot judge the recipe's
    numerics."""
    out = []
    for field in sorted(set(decisions) | set(twin_decisions)):
        if field.startswith(OWN):
            continue
        mine, theirs = decisions.get(field, {}).get("choice"), twin_decisions.get(field, {}).get("choice")
        if mine != theirs:
            out.append(f"{field}: {mine} vs {theirs}")
    return out


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


__all__ = ["OWN", "adopted_decisions", "judge_with_twin", "mismatch", "twin_recipe"]
