"""Planted: a boolean-mask loss, loss[mask].mean() (nonzero: a data-dependent shape, a sync)."""

import torch
from _common import autocast, batch, make_model, make_optimizer


def masked_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_row = (pred.float() - target).pow(2).mean(dim=1)
    return per_row[mask].mean()  # planted


model = make_model()
opt = make_optimizer(model)
batches = [batch() for _ in range(4)]
for step in range(40):
    x, y = batches[step % 4]
    mask = x[:, 0] > 0
    with autocast():
        pred = model(x)
    loss = masked_loss(pred, y, mask)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
