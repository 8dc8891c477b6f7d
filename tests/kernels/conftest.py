"""Kernel tests run the Triton kernels on CUDA when there is one, else in Triton's CPU interpreter.

The kernels are decorated on their first launch (slipstream.kernels.jit), so setting the switch here,
before any test launches one, is enough whatever was imported earlier in this pytest process.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slipstream.kernels.dispatch import poison_outputs  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgot to write fails the comparison."""
    with poison_outputs():
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small shapes run fastest on one thread; on a loaded 2-core box two OpenMP threads spin-wait
    (a tiny GPT step measured 756 ms with 2 threads vs 12 ms with 1 under load 12)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
