"""What a model's forward expects from a batch, learned from the model the user handed over.

Three conventions exist, because causal LMs disagree on who shifts the labels:

- ``shifted`` (the built-in GPT): ``labels[t]`` is the token after ``input_ids[t]``; packed rows
  carry ``document_ids`` (block-diagonal attention) and restarting ``position_ids``.
- ``hf-causal-lm`` (Hugging Face ``...ForCausalLM`` / ``...LMHeadModel``): ``labels == input_ids``
  and the model shifts them itself, so a row of n tokens predicts n-1 of them and a document's first
  token is never a target (its label is -100 where it does not start the row). Packing is expressed
  by restarting ``position_ids`` only, with no 2-D ``attention_mask`` and no cache: transformers
  then builds the block-diagonal mask itself. Right-padded rows need no mask at all under causal
  attention (real tokens never see the padding after them), which keeps SDPA on its is_causal path.
- ``unshifted``: a plain ``nn.Module`` that declares ``slipstream_convention = "unshifted"``: fed like
  a Hugging Face model.

A plain module that declares nothing is fed the built-in GPT's convention (``shifted``), and the
choice is recorded with that reason: declare ``slipstream_convention`` on the class to change it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..recipe import RecipeError


@dataclass(frozen=True)
class BatchConvention:
    name: str
    labels_shifted: bool
    """True: labels[t] is the next token (the collator shifts); False: the model shifts them."""
    packing: Literal["document_ids", "position_ids"]
    """How packed rows tell documents apart: a document_ids tensor, or restarting position_ids."""
    output: Literal["tensor", "model_output"] = "tensor"
    """What forward returns: the loss itself, or an object whose `.loss` it is."""

    @property
    def extra_column(self) -> int:
        """Row columns an item needs beyond its predicted positions (the unshifted input's last token)."""
        return 0 if self.labels_shifted else 1


SHIFTED = BatchConvention("shifted", labels_shifted=True, packing="document_ids")
UNSHIFTED = BatchConvention("unshifted", labels_shifted=False, packing="position_ids")
HF_CAUSAL_LM = BatchConvention(
    "hf-causal-lm", labels_shifted=False, packing="position_ids", output="model_output"
)
CONVENTIONS = {c.name: c for c in (SHIFTED, UNSHIFTED, HF_CAUSAL_LM)}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under torch.compile's wrapper."""
    return getattr(model, "_orig_mod", model)


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel, recognised without importing transformers."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(unwrap(model)).__mro__
    )


def _hf_causal_lm_problem(model: nn.Module) -> str | None:
    """Why this Hugging Face model cannot be trained as a causal LM, or None if it can."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model"
    causal = any(c.__name__.endswith(("ForCausalLM", "LMHeadModel")) for c in type(model).__mro__)
    if not causal:
        return f"{name} is not a causal LM (...ForCausalLM / ...LMHeadModel)"
    return None


def _forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(unwrap(model).forward).parameters)
    except (TypeError, ValueError):
        return {}


def takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether forward can be called with `name=` (by name or through **kwargs; unknown: True)."""
    params = _forward_params(model)
    return not params or name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def detect_convention(model: nn.Module, declared: str | None = None) -> tuple[BatchConvention, str]:
    """The convention to feed `model`, and why. Raises RecipeError for a model that cannot be fed.

    `declared` (or the model class's `slipstream_convention`) wins over detection.
    """
    inner = unwrap(model)
    name = type(inner).__name__
    declared = declared or getattr(inner, "slipstream_convention", None)
    if declared is not None:
        if declared not in CONVENTIONS:
            raise RecipeError(
                f"unknown batch convention {declared!r} for {name}; choose one of {', '.join(CONVENTIONS)}"
            )
        return CONVENTIONS[declared], f"declared by {name}"
    if is_hf_model(inner):
        problem = _hf_causal_lm_problem(inner)
        if problem:
            raise RecipeError(
                f"{problem}: slipstream trains Hugging Face causal LMs (AutoModelForCausalLM); load "
                "the model with AutoModelForCausalLM, or declare slipstream_convention on a wrapper "
                "module whose forward(input_ids, labels) returns the loss"
            )
        return HF_CAUSAL_LM, f"{name} is a Hugging Face causal LM: it shifts labels itself"
    return SHIFTED, (
        f"{name} declares no slipstream_convention: fed the built-in GPT's (labels pre-shifted); "
        "set slipstream_convention = 'unshifted' on the class if forward shifts labels itself"
    )


def loss_of(output: object) -> torch.Tensor:
    """The scalar loss from what forward returned: the tensor itself or an HF ModelOutput's `.loss`."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif getattr(output, "loss", None) is not None:
        loss = output.loss  # type: ignore[attr-defined]
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    else:
        raise RecipeError(
            f"the model returned {type(output).__name__} without a loss; it must return the loss "
            "(or an object with .loss) when called with labels"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise RecipeError(f"the model's loss is {type(loss).__name__}, not a scalar tensor")
    return loss
