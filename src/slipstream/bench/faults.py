"""Planted faults: contenders that train *wrongly* in ways real pipelines do, to prove the parity
guard catches them (issue 24; benchmarks/parity_power.py, tests/test_parity.py).

Each is a RecipeContender subclass that changes one thing a user's pipeline could get wrong (the
data-path faults in `step_inputs`, where a collator or a model call would drop or shift them); run
them through `run_bench(custom=...)` as `label@recipe` (see `fault_contenders`). `lr x 3` needs no
class: it is the recipe `+optimizer.lr=<3 x the reference's>` (`lr_times`).

- `DroppedDocumentMask` (on `pack`): the model never sees what separates packed documents
  (`document_ids` for the built-in GPT, the restarting `position_ids` for a Hugging Face model),
  so packed documents attend to one another.
- `ShiftedLabels`: labels shifted one more position (the model learns to predict t + 2).
- `PureBf16`: the model's weights, norms, softmax and loss all in bf16 (`model.to(bfloat16)`):
  no fp32 master weights and no fp32 reductions where the loss is decided.
- `FrozenLayer`: the first block of the model's layer stack never updates (requires_grad off).
"""

from __future__ import annotations

import torch
from torch import nn

from ..presets import resolve_recipe
from .runner import RecipeContender, custom_factory


class DroppedDocumentMask(RecipeContender):
    def step_inputs(self, batch):
        drop = "document_ids" if self.session.convention.packing == "document_ids" else "position_ids"
        return super().step_inputs(type(batch)({k: v for k, v in batch.items() if k != drop}))


class ShiftedLabels(RecipeContender):
    def step_inputs(self, batch):
        labels = batch["labels"]
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        return super().step_inputs(type(batch)({**batch, "labels": shifted}))


class PureBf16(RecipeContender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.to(torch.bfloat16)  # parameters change dtype in place: the optimizer keeps them
        self.precision = "bf16"


def layer_stack(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the first ModuleList of two or more modules holding parameters."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and any(True for _ in module.parameters()):
            return module
    raise ValueError(f"{type(model).__name__} has no layer stack (a ModuleList of blocks) to freeze")


class FrozenLayer(RecipeContender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in layer_stack(self.model)[0].parameters():
            p.requires_grad_(False)  # AdamW skips parameters without a gradient


FAULTS: dict[str, tuple[str, type[RecipeContender]]] = {
    "no-doc-mask": ("pack", DroppedDocumentMask),
    "label-shift": ("baseline", ShiftedLabels),
    "bf16-pure": ("baseline", PureBf16),
    "frozen-layer": ("baseline", FrozenLayer),
}
"""fault -> (the preset it starts from, the contender class)."""


def lr_times(spec: str, factor: float) -> str:
    """`spec` with its learning rate multiplied by `factor` (a planted fault when factor is 3)."""
    return f"{spec}+optimizer.lr={resolve_recipe(spec).optimizer.lr * factor:g}"


def fault_contenders(extra: str = "", faults: tuple[str, ...] = tuple(FAULTS)) -> tuple[list[str], dict]:
    """(bench recipe names, run_bench custom factories) for the planted faults, each preset with
    `extra` overrides appended (e.g. "+shapes.max_len=512")."""
    names, custom = [], {}
    for fault in faults:
        preset, cls = FAULTS[fault]
        name = f"{fault}@{preset}{extra}"
        names.append(name)
        custom[name] = custom_factory(cls)
    return names, custom


__all__ = [
    "FAULTS",
    "DroppedDocumentMask",
    "FrozenLayer",
    "PureBf16",
    "ShiftedLabels",
    "fault_contenders",
    "layer_stack",
    "lr_times",
]
