"""Choose where a kernel runs: Triton on CUDA, pure torch on CPU.

Triton is an optional dependency (``pip install slipstream[kernels]``), so nothing here imports it at
module import time: kernels are built on first launch (see ``triton_lang``). That also means the
``TRITON_INTERPRET`` switch only has to be set before the first launch, not before ``import slipstream``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch", "liger", "compile"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch", "liger", "compile")
ALTERNATIVES: tuple[str, ...] = ("liger", "compile")
"""Backends that are not ours: Liger-Kernel's Triton ops, or inductor's code for the torch reference
(see slipstream.kernels.alternatives). kernels.ops=auto times them beside ours and keeps the fastest."""

# Debug switch for tests: fresh outputs start as NaN so an element a kernel forgot to write fails loudly.
_POISON = contextvars.ContextVar("slipstream_kernels_poison", default=False)


def interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (slow; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """Turn ``auto | triton | torch | liger | compile`` plus a device into the backend that will run.

    ``auto`` picks Triton only on CUDA (with Triton installed); everywhere else the pure-torch path.
    Forcing ``triton`` on a CPU is an error unless ``TRITON_INTERPRET=1`` is set; ``liger`` needs
    CUDA and the liger-kernel package; ``compile`` (inductor on the torch reference) runs anywhere.
    """
    if requested not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested in ("torch", "compile"):
        return requested
    if requested == "liger":
        problem = liger_problem(device)
        if problem:
            raise RuntimeError(f"kernel backend 'liger' {problem}")
        return "liger"
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(
            "kernel backend 'triton' needs the triton package: pip install 'slipstream[kernels]' "
            "(or use backend='auto'/'torch')"
        )
    if device.type != "cuda" and not interpreter_on():
        raise RuntimeError(
            f"kernel backend 'triton' needs a CUDA device, got {device.type!r}: use backend='auto' or "
            "'torch' on CPU, or set TRITON_INTERPRET=1 before the first launch to run the kernels in "
            "Triton's (slow) CPU interpreter"
        )
    return "triton"


def liger_problem(device: torch.device | str) -> str | None:
    """Why Liger-Kernel cannot run here (None: it can)."""
    if torch.device(device).type != "cuda":
        return f"needs a CUDA device, got {torch.device(device).type!r}"
    if not liger_available():
        return "needs the liger-kernel package: pip install 'slipstream[gpu]' (or pip install liger-kernel)"
    return None


def triton_lang():
    """Import (triton, triton.language) on first use, with a message that says how to install it."""
    if not triton_available():
        raise RuntimeError("Triton kernels need the triton package: pip install 'slipstream[kernels]'")
    import triton
    import triton.language as tl

    return triton, tl


def check_launchable(*tensors: torch.Tensor) -> None:
    """Fail before a launch with a readable message instead of a Triton pointer error."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreter_on():
            raise RuntimeError(
                f"Triton kernel got a tensor on {t.device}: move it to CUDA, use backend='torch', "
                "or set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter"
            )


@contextlib.contextmanager
def poison_outputs(on: bool = True) -> Iterator[None]:
    """Within this block every kernel output starts as NaN (testing aid; costs one fill per output)."""
    token = _POISON.set(on)
    try:
        yield
    finally:
        _POISON.reset(token)


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled under ``poison_outputs`` (ints: a wild value)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON.get():
        out.fill_(float("nan") if dtype.is_floating_point else -12345)
    return out


def num_programs(device: torch.device, per_sm: int = 2, cpu: int = 4) -> int:
    """How many persistent programs to launch for row-looping kernels (norm backward)."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return cpu  # the interpreter runs programs one after another: few programs, long loops


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
