"""No planted problem: the profile must report no warning-level finding."""

import torch
from _common import autocast, batch, make_model, make_optimizer

model = make_model()
opt = make_optimizer(model)
batches = [batch() for _ in range(4)]
losses = []
for step in range(40):
    x, y = batches[step % 4]
    with autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.detach())  # stays on the device: no sync
print("mean loss", torch.stack(losses).mean().item())
