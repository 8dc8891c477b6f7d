"""No torch.optim optimizer: steps are closed by slipstream's mark_step()."""

import torch
from _common import autocast, batch, make_model

from slipstream.profile import mark_step

model = make_model()
batches = [batch() for _ in range(4)]
for step in range(40):
    x, y = batches[step % 4]
    with autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-3 * p.grad
            p.grad = None
    mark_step()
