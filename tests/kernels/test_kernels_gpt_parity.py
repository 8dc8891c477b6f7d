"""The built-in GPT trains to the same loss with kernels on as with them off (100 steps, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.kernels import KERNEL_OPS, apply_kernels

gpt = pytest.importorskip("slipstream.workloads.gpt", reason="built-in GPT workload not importable")


def train(model, steps, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids, labels = batches[step % len(batches)]
        loss = model(ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("mlp", "norm", "steps"), [("gelu", "layernorm", 100), ("swiglu", "rmsnorm", 100)])
def test_gpt_kernels_on_matches_off(mlp, norm, steps):
    torch.manual_seed(0)
    model = gpt.build_gpt("tiny", max_len=16, mlp=mlp, norm=norm)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        labels = ids.roll(-1, dims=1)
        labels[:, -1] = -100
        labels[0, :6] = -100  # a padded / prompt stretch
        batches.append((ids, labels))
    on = copy.deepcopy(model)
    report = apply_kernels(on, list(KERNEL_OPS), "cpu")  # every matching module, torch backend
    assert report.swapped["linear_cross_entropy"] == 1
    assert report.swapped["layer_norm" if norm == "layernorm" else "rms_norm"] == 2 * 2 + 1
    assert report.swapped["gelu_tanh" if mlp == "gelu" else "swiglu"] == 2
    off_losses = train(model, steps, batches)
    on_losses = train(on, steps, batches)
    assert off_losses[-1] < off_losses[0] - 0.5  # it did learn: the comparison means something
    # same curve up to fp32 reordering in the chunked loss: a real difference would compound
    torch.testing.assert_close(torch.tensor(on_losses), torch.tensor(off_losses), rtol=1e-3, atol=1e-3)
