"""The recipe's optimizer: parameter groups (decay matrices only), the kernel implementation
(fused, foreach, for-loop), and parameters without a model for timing implementations on copies."""

from __future__ import annotations

import torch
from torch import nn

from .recipe import OptimizerConfig


def build_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay matrices only; biases, norms and embeddings' 1-D params are not decayed (GPT-2 practice)."""
    seen, decay, no_decay = set(), [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_optimizer_impl(cfg: OptimizerConfig, device: torch.device) -> str:
    """auto: fused on CUDA (one kernel for all parameters), torch's own default elsewhere."""
    if cfg.impl == "auto":
        return "fused" if device.type == "cuda" else "auto"
    return cfg.impl


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    impl: dict[str, bool] = {}
    choice = resolve_optimizer_impl(cfg, device)
    if choice == "fused":
        impl = {"fused": True}
    elif choice == "foreach":
        impl = {"foreach": True}
    elif choice == "for-loop":
        impl = {"foreach": False}
    groups = build_param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **impl)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, **impl)


class Params(nn.Module):
    """Parameters without a model: what build_optimizer needs to build an optimizer over copies."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors = nn.ParameterList(nn.Parameter(t.detach(), requires_grad=True) for t in tensors)
        for p, t in zip(self.tensors, tensors):
            p.grad = t.grad
