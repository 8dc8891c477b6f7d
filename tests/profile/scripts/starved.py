"""Planted: a starved loader (the dataset sleeps in __getitem__, no workers)."""

import time

import torch
from _common import DIM, autocast, make_model, make_optimizer


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.005)  # decoding an image, say
        return torch.randn(DIM), torch.randn(DIM)


model = make_model()
opt = make_optimizer(model)
loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=8)
for x, y in loader:  # planted
    with autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
