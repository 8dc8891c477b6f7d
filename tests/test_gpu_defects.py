"""The GPU defects of issue 16, each checked on CPU: torch.cuda's functions are faked where the
logic under test only decides *whether and how* to call them. docs/gpu.md lists them."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.metrics import MetricsTracker
from slipstream.session import seed_everything

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


# ----------------------------------------------------------------------------- deterministic cuBLAS


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]


@pytest.mark.parametrize("cuda", [True, False])
def test_deterministic_sets_the_cublas_workspace_on_cuda_only(monkeypatch, restore_determinism, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seed_everything(0, deterministic=True)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (":4096:8" if cuda else None)
    assert torch.are_deterministic_algorithms_enabled()


def test_deterministic_keeps_a_users_cublas_workspace(monkeypatch, restore_determinism):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    seed_everything(0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seed_everything(0, deterministic=False)  # not asked for: nothing set
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
