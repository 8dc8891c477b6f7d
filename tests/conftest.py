"""Suite-wide hooks: tests marked `gpu` skip, with the reason printed, where no CUDA device is visible.

Without CUDA, Triton kernels run in Triton's CPU interpreter. The switch is set here, in the conftest
pytest loads first: Triton decorates its own library functions when it is first imported (a test
module importing transformers imports it), and a kernel interpreted later cannot call those.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# bench and optimize train the reference 100 optimizer steps before judging parity (enough for a
# planted fault to show); the suite checks their machinery on a few steps, so it judges after 1.
# Tests of the step budget itself pass parity_steps explicitly.
os.environ.setdefault("SLIPSTREAM_PARITY_STEPS", "1")

# transformers binds its log handler to sys.stderr at its first message. Were that inside a capsys
# test, every later transformers warning would go to that test's closed stream, and the next test
# that reads its own stderr would find "--- Logging error ---" there. Bind it now, to the suite's.
from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.get_logger("transformers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def machine_like(monkeypatch):
    """Make every `auto` see a machine with these matmul figures (never this host's real speed):
    `machine_like(bf16=0.01)` is an AVX2-only CPU, `machine_like(bf16=4.0)` an AMX one."""
    from slipstream import machine

    def use(
        bf16: float, fp16: float = 1.0, compile_ok: bool = True, tf32: float | None = None
    ) -> machine.MachineProbe:
        fp32 = 100e9
        p = machine.MachineProbe(
            fingerprint={"cpu_model": "test CPU", "cpu_capability": "TEST", "threads": 1, "torch": "x"},
            key="test",
            device="cpu",
            matmul_flops_per_s={
                "fp32": {"1024": fp32},
                "bf16": {"1024": bf16 * fp32},
                "fp16": {"1024": fp16 * fp32},
                **({"tf32": {"1024": tf32 * fp32}} if tf32 is not None else {}),
            },
            matmul_notes={},
            copy_bytes_per_s={"host_memcpy": 1e10},
            checks={"compile": machine.Check(compile_ok, "test figures", 1.0)},
        )
        monkeypatch.setattr(machine, "probe", lambda *args, **kwargs: p)
        return p

    return use
