"""The GPU defects of issue 16, each checked on CPU: torch.cuda's functions are faked where the
logic under test only decides *whether and how* to call them. docs/gpu.md lists them."""

from __future__ import annotations

import torch

from slipstream.metrics import MetricsTracker

# ----------------------------------------------------------------------------- step times wait for the device


def test_step_time_synchronises_cuda_and_not_cpu(monkeypatch):
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda = MetricsTracker(torch.device("cuda"), "bf16")
    cuda.on_batch(object(), 0.0)
    cuda.end_step()
    assert synced == [torch.device("cuda")] and len(cuda.records) == 1
    cpu = MetricsTracker(torch.device("cpu"), "fp32")
    cpu.on_batch(object(), 0.0)
    cpu.end_step()
    assert synced == [torch.device("cuda")]  # no sync on CPU (nor a CUDA call at all)
