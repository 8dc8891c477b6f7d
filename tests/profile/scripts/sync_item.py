"""Planted: a per-step .item()."""

import torch
from _common import autocast, batch, make_model, make_optimizer

model = make_model()
opt = make_optimizer(model)
batches = [batch() for _ in range(4)]
total = 0.0
for step in range(40):
    x, y = batches[step % 4]
    with autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total += loss.item()  # planted
print("total", total)
