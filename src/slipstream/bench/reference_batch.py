"""The reference's tokens per step on a GPU: searched once per benchmark, then shared by everyone.

On the first H200 run every `bench` contender was held to the reference's CPU-sized default
(~1,400 real tokens per optimizer step for an 88M Llama), which left the GPU >= 96% idle and made
the whole comparison one of launch overheads. So where a session would search the batch size
(`shapes.batch_search=auto`, CUDA, `tokens_per_batch` not pinned: slipstream.batch_size), `bench`
and `optimize` search it once, on the reference recipe's model and the full training corpus,
before any contender is built. Every contender's session then starts with that decision recorded
(`adopt`), so none searches again (a paired run's windows hold too few documents to search on),
the reference trains at the searched size and everyone else is matched to its real tokens per
step as before. A size the user pinned is never searched.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..decisions import Decision
from ..recipe import Recipe
from ..runtime import resolve_device
from ..session import Session


def wants_search(recipe: Recipe) -> bool:
    """Whether a session of `recipe` would search its tokens per batch (slipstream.batch_size)."""
    from ..batch_size import searches_batch

    return searches_batch(recipe.shapes, resolve_device(recipe.runtime.device))


def search_reference_batch(recipe: Recipe, model_factory, data, say=lambda msg: None) -> Decision | None:
    """The `shapes.tokens_per_batch` decision for `recipe` on `data.train` (None where it would not
    search). `model_factory()` builds a fresh model; it is timed eager (no compile, no kernel swaps:
    what the search ranks is batch sizes, not recipes) in the recipe's precision, then freed."""
    if not wants_search(recipe):
        return None
    plain = replace(
        recipe, compile=replace(recipe.compile, mode="off"), kernels=replace(recipe.kernels, ops="off")
    )
    say(f"searching the reference's tokens per batch on {resolve_device(recipe.runtime.device)}")
    with Session(plain) as session:
        session.prepare_model(model_factory())
        decision = session._decide_tokens_per_batch(
            data.train, plain.shapes, pad_id=data.pad_id, lengths=data.train_lengths
        )
        session.local_model = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trials' activations: the contenders need the memory
    say(f"tokens per batch {decision.choice}: {decision.reason.splitlines()[0]}")
    return decision


def adopt(session: Session, decision: Decision | None) -> None:
    """Start `session` with the benchmark's searched size (it then does not search itself)."""
    if decision is not None and session.recipe.shapes.batch_search == "auto":
        session.record(decision)


__all__ = ["adopt", "search_reference_batch", "wants_search"]
