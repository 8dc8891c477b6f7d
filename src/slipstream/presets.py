"""Named recipes, and the one place that turns a recipe *spec* into a Recipe.

A spec is a preset name (`baseline`), a .toml/.json file, or either followed by `+field=value`
overrides (`baseline+precision.dtype=bf16+shapes.max_len=512`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from .recipe import (
    CompileConfig,
    KernelsConfig,
    PrecisionConfig,
    Recipe,
    RecipeError,
    ShapesConfig,
    load_recipe,
)

PRESETS: dict[str, Callable[[], Recipe]] = {}


def register_preset(name: str) -> Callable[[Callable[[], Recipe]], Callable[[], Recipe]]:
    def decorator(fn: Callable[[], Recipe]) -> Callable[[], Recipe]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is already registered")
        PRESETS[name] = fn
        return fn

    return decorator


@register_preset("baseline")
def baseline() -> Recipe:
    """The naive pipeline: every sequence padded to max_len, fp32, eager."""
    return Recipe(name="baseline", shapes=ShapesConfig(mode="pad_max"))


@register_preset("pad-batch")
def pad_batch() -> Recipe:
    """Pad each batch only to its longest sequence: less waste, but a new shape almost every step."""
    return Recipe(name="pad-batch", shapes=ShapesConfig(mode="pad_batch"))


@register_preset("bf16")
def bf16() -> Recipe:
    """The baseline with bf16 autocast (fp32 master weights)."""
    return Recipe(name="bf16", shapes=ShapesConfig(mode="pad_max"), precision=PrecisionConfig(dtype="bf16"))


@register_preset("bucket")
def bucket() -> Recipe:
    """Pad to 8 planned length buckets with token-budget batches: little padding, at most 8 shapes."""
    return Recipe(name="bucket", shapes=ShapesConfig(mode="bucket", buckets=8))


@register_preset("pack")
def pack() -> Recipe:
    """Pack documents into full rows (best-fit-decreasing) with document-masked attention."""
    return Recipe(name="pack", shapes=ShapesConfig(mode="pack", pack_algorithm="bfd"))


@register_preset("prefetch")
def prefetch() -> Recipe:
    """The baseline with batches prepared ahead on a background thread (depth 2) and per-sample work
    (vision-synthetic decode + augment) on one worker thread: the step stops waiting for data."""
    from .recipe import DataflowConfig

    return Recipe(name="prefetch", dataflow=DataflowConfig(prefetch=True, prefetch_depth=2, workers=1))


DEMO_ORDER = ("baseline", "bf16", "pad-batch", "bucket", "pack", "full", "auto")
"""Recipes `slipstream bench --recipes demo` compares, in this order, where registered."""


def demo_recipes() -> list[str]:
    return [name for name in DEMO_ORDER if name in PRESETS]


def get_preset(name: str) -> Recipe:
    if name not in PRESETS:
        raise RecipeError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def resolve_recipe(spec: str | os.PathLike[str] | Recipe, overrides: Sequence[str] | None = None) -> Recipe:
    """Turn a preset name, recipe file, or `base+section.field=value+...` into a Recipe, then apply
    `overrides` (`section.field=value` strings, as given to `--set`)."""
    if overrides:
        return resolve_recipe(spec).override(*overrides)
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"a recipe is a Recipe, a preset name ('bf16'), a recipe file path or a "
            f"'preset+section.field=value' spec, not {type(spec).__name__} {spec!r}"
        )
    base, *overrides = spec.split("+")
    if not base.strip():
        raise RecipeError(
            f"recipe {spec!r} names no preset or file before its overrides; "
            "start with one, e.g. baseline+shapes.max_len=512"
        )
    if base.endswith((".toml", ".json")) or (base not in PRESETS and Path(base).exists()):
        recipe = load_recipe(base)
    else:
        recipe = get_preset(base)
    if overrides:
        recipe = replace(recipe.override(*overrides), name=spec)
    return recipe


@register_preset("full")
def full() -> Recipe:
    """Packed rows, fused kernels, and the cheapest dtype that measured faster here (precision auto:
    bf16 on AMX CPUs and GPUs, fp32 on AVX2-only CPUs where bf16 matmuls are ~75x slower).

    torch.compile is left off: on a 2-core CPU it measured within noise of eager for this model
    (3.84x vs 3.67x baseline, `slipstream bench`) while costing 14-24 s of compile per run."""
    return replace(
        pack(), name="full", precision=PrecisionConfig(dtype="auto"), kernels=KernelsConfig(ops="auto")
    )


@register_preset("auto")
def auto() -> Recipe:
    """Every choice decided on this machine and model: shapes by timing bucket against pack on the
    model, precision (and TF32 for fp32 matmuls) by the machine probe, each fused kernel by timing it
    against the model's own module, compile by timing a step (CUDA), tokens per batch by the knee
    of measured throughput (CUDA). Each decision and its reason land in the metrics (`decisions`)."""
    return Recipe(
        name="auto",
        shapes=ShapesConfig(mode="auto"),
        precision=PrecisionConfig(dtype="auto", tf32="auto"),
        kernels=KernelsConfig(ops="auto"),
        compile=CompileConfig(mode="auto"),
    )
