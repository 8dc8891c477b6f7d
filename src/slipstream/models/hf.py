"""Hugging Face causal LMs, trained as transformers itself would, only faster.

Everything here changes the one instance the user handed over (no class is patched):

- `prepare_forward`: the instance's forward turns the KV cache off whenever labels are given.
  transformers honours packed `position_ids` only when there is no cache, and a training forward
  builds one by default (`config.use_cache=True`): packed documents would then attend to each other.
- `apply_hf_kernels`: the fused linear cross-entropy over the LM head (the [tokens, vocab] logits
  are never built) and Llama-style SwiGLU MLPs, plus the module swaps of `kernels.apply_kernels`
  (nn.LayerNorm in GPT-2, Llama-family RMSNorms). The fused head is checked against the model's
  own loss on a small batch before it is kept: a model whose head does more than a linear layer
  (logit soft-capping, scaling) keeps its own forward, with the reason in the report.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
_SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_FUSED_HEAD_CHECK_TOL = 1e-4


def _class_forward(model: nn.Module):
    return type(model).forward


def prepare_forward(model: nn.Module) -> None:
    """Install the training forward on this instance (idempotent): no cache when labels are given."""
    if getattr(model, "_slipstream_forward", False):
        return
    model._slipstream_forward = True  # type: ignore[attr-defined]
    model._slipstream_fused_head = None  # type: ignore[attr-defined]  # kernel backend when fused

    def forward(self, *args, **kwargs):
        if kwargs.get("labels") is None:  # generation and plain inference: the class's own forward
            return _class_forward(self)(self, *args, **kwargs)
        kwargs.setdefault("use_cache", False)
        if self._slipstream_fused_head is not None and not kwargs.get("output_hidden_states"):
            return _fused_head_forward(self, *args, **kwargs)
        return _class_forward(self)(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)


def _fused_head_forward(model: nn.Module, input_ids=None, labels=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ..kernels import fused_linear_cross_entropy

    for key in ("logits_to_keep", "num_items_in_batch", "return_dict"):
        kwargs.pop(key, None)
    hidden = model.base_model(input_ids=input_ids, **kwargs)[0]
    head = model.get_output_embeddings()
    # The model's own loss shifts the same way: position t predicts labels[t + 1].
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        targets.reshape(-1).to(hidden.device),
        bias=head.bias,
        ignore_index=IGNORE_INDEX,
        backend=model._slipstream_fused_head,
    )
    return CausalLMOutputWithPast(loss=loss)


def _fused_head_problem(model: nn.Module, backend: str) -> str | None:
    """Why the fused head would not compute this model's loss (None: checked equal on a small batch)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"the output head is {type(head).__name__}, not nn.Linear"
    if not hasattr(model, "base_model") or model.base_model is model:
        return "no separate base model to take the hidden states from"
    vocab = min(int(head.weight.shape[0]), 256)
    device = head.weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 16), generator=gen).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = _class_forward(model)(model, input_ids=ids, labels=ids, use_cache=False).loss
            model._slipstream_fused_head = backend
            fused = _fused_head_forward(model, input_ids=ids, labels=ids, use_cache=False).loss
    except Exception as err:  # a model the fused path cannot drive keeps its own forward
        return f"the fused head failed on this model ({type(err).__name__}: {err})"
    finally:
        model._slipstream_fused_head = None
        model.train(was_training)
    gap = abs(float(own) - float(fused))
    if not gap <= _FUSED_HEAD_CHECK_TOL * max(1.0, abs(float(own))):
        return f"its loss differs from the model's own by {gap:.2e} (the head does more than a linear layer)"
    return None


def _swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__ in _SWIGLU_MLPS and getattr(m.config, "hidden_act", None) == "silu"
    ]


def _swap_swiglu_mlps(model: nn.Module, backend: str) -> int:
    from ..kernels import swiglu

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=backend))

    mlps = _swiglu_mlps(model)
    for module in mlps:
        module.forward = types.MethodType(forward, module)
    return len(mlps)


def apply_hf_kernels(model: nn.Module, ops: str | Sequence[str], device: torch.device, *, chooser=None):
    """Fused kernels on a Hugging Face causal LM instance; returns a kernels.KernelSwapReport.

    Under ``auto`` each op this model has is timed against the model's own code by ``chooser``
    (slipstream.kernels.chooser) and swapped only where a candidate wins."""
    from ..kernels import apply_kernels, resolve_backend
    from ..kernels.swap import KernelSwapReport, active_ops, parse_ops, present_ops

    prepare_forward(model)
    report = KernelSwapReport(backend=resolve_backend("auto", device))
    names = parse_ops(ops)
    # The LM head and the MLP are code inside the model's forward, changed on this instance; the
    # fused head is checked against the model's own loss first (on the torch path: cheap, exact).
    present = present_ops(model, [op for op in names if op not in ("linear_cross_entropy", "swiglu")])
    if "linear_cross_entropy" in names:
        problem = _fused_head_problem(model, "torch")
        if problem is None:
            present.append("linear_cross_entropy")
        else:
            report.skipped["linear_cross_entropy"] = problem
    if "swiglu" in names and _swiglu_mlps(model):
        present.append("swiglu")
    active = active_ops(ops, "auto", device, report, present, model, chooser)
    report.backends = {op: b for op, b in active.items() if op in present}
    by_module = [op for op in report.backends if op not in ("linear_cross_entropy", "swiglu")]
    for op in by_module:  # one backend per op: swapped op by op
        done = apply_kernels(model, [op], device, backend=report.backends[op])
        report.swapped.update(done.swapped)
    if "linear_cross_entropy" in report.backends:
        model._slipstream_fused_head = report.backends["linear_cross_entropy"]  # type: ignore[attr-defined]
        report.swapped["linear_cross_entropy"] = 1
    if "swiglu" in report.backends:
        report.swapped["swiglu"] = _swap_swiglu_mlps(model, report.backends["swiglu"])
    for op in names:
        if op not in present and op not in report.skipped:
            report.skipped[op] = "not in this model"
    return report
