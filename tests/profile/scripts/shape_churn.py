"""Planted: shape churn under torch.compile (a new sequence length every step)."""

import torch
from _common import DIM, autocast, make_model, make_optimizer

model = make_model()
compiled = torch.compile(model, backend="eager")  # eager backend: dynamo and its guards, compiles fast
opt = make_optimizer(model)
for step in range(40):
    x = torch.randn(2, 4 + step, DIM)
    with autocast():
        out = compiled(x)  # planted
    loss = out.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
