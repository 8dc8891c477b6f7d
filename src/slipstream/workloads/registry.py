"""Workloads by name, so bench / profile / tune / train can all say `--workload gpt-stdlib`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from ..recipe import RecipeError


@dataclass(frozen=True)
class WorkloadData:
    train: Sequence
    """Training sequences (1-D token id arrays)."""
    validation: Sequence
    """Held-out sequences for validation loss."""
    train_lengths: np.ndarray
    validation_lengths: np.ndarray
    pad_id: int
    vocab_size: int


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sizes: tuple[str, ...]
    build_model: Callable[[str, int], nn.Module]
    """(size, max_len) -> a model whose forward(**batch) returns the mean loss."""
    load_data: Callable[[], WorkloadData]
    """The workload's data (WorkloadData of token sequences, or the workload's own type with make_loaders)."""
    make_loaders: Callable[[Any, Any], tuple[Any, Any]] | None = None
    """(session, data) -> (train loader, validation loader) for data that are not token sequences
    (images); None: token sequences through session.prepare_loader."""

    def model(self, size: str, max_len: int) -> nn.Module:
        if size not in self.sizes:
            raise RecipeError(
                f"workload {self.name!r} has no size {size!r}; choose one of {', '.join(self.sizes)}"
            )
        return self.build_model(size, max_len)


WORKLOADS: dict[str, Workload] = {}


def register_workload(workload: Workload) -> Workload:
    if workload.name in WORKLOADS:
        raise ValueError(f"workload {workload.name!r} is already registered")
    WORKLOADS[workload.name] = workload
    return workload


class _NamedFamily:
    """Workloads built from a self-describing name (`user:...`): how to build one and its slug."""

    def __init__(self, build: Callable[[str], Workload], slug: Callable[[str], str]):
        self.build, self.slug = build, slug
        self.built: dict[str, Workload] = {}


# Families register themselves (workloads/user.py: "user"); the registry imports none of them, so
# a family can use the registry's built-in workloads without an import cycle.
_FAMILIES: dict[str, _NamedFamily] = {}


def register_family(prefix: str, build: Callable[[str], Workload], slug: Callable[[str], str]) -> None:
    """Names `prefix:...` are workloads `build(name)` makes (once per name), filed as `slug(name)`."""
    _FAMILIES[prefix] = _NamedFamily(build, slug)


def _family(name: str) -> _NamedFamily | None:
    prefix, sep, _ = name.partition(":")
    return _FAMILIES.get(prefix) if sep else None


def get_workload(name: str) -> Workload:
    """A registered workload, or the user's own built from its self-describing `user:...` name
    (so a name handed to a subprocess rebuilds the same model and data there)."""
    family = _family(name)
    if family is not None:
        if name not in family.built:
            family.built[name] = family.build(name)
        return family.built[name]
    if name not in WORKLOADS:
        raise RecipeError(
            f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))} "
            "(or your own: --model module:factory --data PATH, see docs/own-model.md)"
        )
    return WORKLOADS[name]


def workload_slug(name: str) -> str:
    """The name where it must be a file name (a user workload's name holds paths)."""
    family = _family(name)
    return family.slug(name) if family is not None else name


def _gpt_stdlib_data() -> WorkloadData:
    from .corpus import PAD_ID, VOCAB_SIZE, load_stdlib_corpus

    corpus = load_stdlib_corpus()
    return WorkloadData(
        train=corpus.train,
        validation=corpus.validation,
        train_lengths=corpus.train.lengths,
        validation_lengths=corpus.validation.lengths,
        pad_id=PAD_ID,
        vocab_size=VOCAB_SIZE,
    )


def _gpt_stdlib_model(size: str, max_len: int) -> nn.Module:
    from .gpt import build_gpt

    return build_gpt(size, max_len=max_len)


register_workload(
    Workload(
        name="gpt-stdlib",
        description="byte-level decoder-only GPT on this interpreter's standard library, one document per def/class",
        sizes=("tiny", "small", "gpt2-124m"),
        build_model=_gpt_stdlib_model,
        load_data=_gpt_stdlib_data,
    )
)


def _vision_data() -> Any:
    from .vision import load_vision_data

    return load_vision_data()


def _vision_model(size: str, max_len: int) -> nn.Module:
    from .vision import build_cnn

    return build_cnn(size)  # images have no sequence length: max_len does not apply


def _vision_loaders(session: Any, data: Any) -> tuple[Any, Any]:
    from .vision import make_vision_loaders

    return make_vision_loaders(session, data)


register_workload(
    Workload(
        name="vision-synthetic",
        description="small CNN on synthetic JPEG images decoded and augmented with Pillow per sample (data-bound)",
        sizes=("tiny", "small"),
        build_model=_vision_model,
        load_data=_vision_data,
        make_loaders=_vision_loaders,
    )
)
