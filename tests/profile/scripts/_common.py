"""Shared by the planted-problem scripts: a small clean setup (bf16 autocast, fused AdamW)."""

import torch
from torch import nn

torch.manual_seed(0)

DIM = 128


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def batch(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, DIM), torch.randn(rows, DIM)
