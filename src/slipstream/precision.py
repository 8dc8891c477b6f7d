"""Precision policy: which dtype the step computes in, loss scaling for fp16, and the parity guard.

Weights always stay fp32 ("master weights"); bf16/fp16 are autocast compute dtypes, fp8 swaps
Linear layers for torchao's float8 training layers. fp16 needs dynamic loss scaling: we build on
`torch.amp.GradScaler` and only add the accounting (skipped steps, current scale) and the order
of operations (unscale before clipping, skip on inf/nan).

The parity guard itself lives in slipstream.parity (re-exported here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# The parity guard lives in slipstream.parity (one guard for bench, optimize and precision); its
# names stay importable from here.
from .parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_PARITY_WINDOW, ParityResult, parity
from .recipe import PrecisionConfig, RecipeError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- device support


def cpu_supports_fp16() -> bool:
    """True where oneDNN has fp16 matmuls on this CPU (AVX512-FP16, AMX-FP16, or its AVX-512 path)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # builds without oneDNN
        return False


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def resolve_precision(cfg: PrecisionConfig, device: torch.device) -> str:
    """The dtype actually used: `auto` is decided by measurement (`resolve_precision_decision`);
    unusable choices fail with an error that names the field and the fix."""
    return resolve_precision_decision(cfg, device).choice


def resolve_precision_decision(cfg: PrecisionConfig, device: torch.device):
    """The dtype and why: for `auto`, the machine probe's matmul figures decide (bf16 only where it
    measured faster than fp32 here: it is ~75x slower on AVX2-only CPUs); an explicit dtype is
    checked and kept."""
    from .decisions import Decision, decide_precision

    if cfg.dtype == "auto":
        return decide_precision(device)
    return Decision("precision.dtype", _checked_dtype(cfg, device), "set in the recipe")


def _checked_dtype(cfg: PrecisionConfig, device: torch.device) -> str:
    dtype = cfg.dtype
    if dtype == "fp16":
        if device.type == "cpu" and not cpu_supports_fp16():
            raise RecipeError(
                "precision.dtype=fp16 needs fp16 matmuls, which this CPU does not have; use precision.dtype=bf16"
            )
        if device.type not in ("cpu", "cuda"):
            raise RecipeError(f"precision.dtype=fp16 is not supported on {device.type}; use bf16 or fp32")
    if dtype == "fp8":
        if device.type != "cuda":
            raise RecipeError("precision.dtype=fp8 needs a CUDA GPU of compute capability >= 8.9; use bf16")
        major, minor = cuda_capability(device)
        if (major, minor) < (8, 9):
            raise RecipeError(
                f"precision.dtype=fp8 needs compute capability >= 8.9 (this GPU has {major}.{minor}); use bf16"
            )
    if (
        dtype == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise RecipeError("precision.dtype=bf16 is not supported by this GPU; use precision.dtype=fp16")
    return dtype


# ----------------------------------------------------------------------------- autocast


@contextlib.contextmanager
def autocast(precision: str, device: torch.device, *, cache_enabled: bool = True) -> Iterator[None]:
    """Autocast for bf16/fp16 (fp8 computes the rest of the model in bf16); no-op for fp32.

    `cache_enabled=False` is needed while capturing CUDA graphs (the cast cache would outlive the graph).
    """
    dtype = AUTOCAST_DTYPES.get("bf16" if precision == "fp8" else precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype, cache_enabled=cache_enabled):
        yield


def apply_fp8(model: nn.Module, *, emulate: bool = False) -> dict[str, object]:
    """Swap nn.Linear layers for torchao float8 training layers (in place; state_dict keys unchanged).

    float8 matmuls need every inner dimension to be a multiple of 16. The features are (see
    `eligible`); the flattened batch x length is the inner dimension of the weight gradient, and
    planned shapes (multiples of 8, free batch sizes), a last partial batch or a user's loader do not
    promise it, so `pad_inner_dim` zero-pads it to the next multiple of 16 for the matmul (torchao's
    default is off: `torch._scaled_mm` then raises in backward). `emulate` runs the float8 math in
    plain torch (tests on CPU)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise RecipeError(
            "precision.dtype=fp8 needs torchao: `pip install torchao` (or the slipstream[gpu] extra)"
        ) from err

    def eligible(module: nn.Module, fqn: str) -> bool:
        # float8 matmuls need both dims divisible by 16; the tied LM head stays in bf16.
        if not isinstance(module, nn.Linear):
            return True
        return module.in_features % 16 == 0 and module.out_features % 16 == 0 and "lm_head" not in fqn

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    config = Float8LinearConfig(pad_inner_dim=True, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    after = sum(type(m) is nn.Linear for m in model.modules())
    return {"fp8_linears": before - after}


# ----------------------------------------------------------------------------- loss scaling


class LossScaler:
    """Dynamic loss scaling on top of torch.amp.GradScaler, with the accounting metrics need.

    `step` returns True when the optimizer step ran and False when it was skipped because a
    gradient held inf/nan (GradScaler then halves the scale).
    """

    def __init__(self, device: torch.device, cfg: PrecisionConfig):
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=cfg.loss_scale_init, growth_interval=cfg.loss_scale_growth_interval
        )
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide grads by the scale in place (call before clipping so the clip sees true norms)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips optimizer.step() when any grad is inf/nan
        self.scaler.update()
        # GradScaler lowers the scale only when it found inf/nan, i.e. only when it skipped the step.
        skipped = self.scaler.get_scale() < scale_before
        self.skipped_steps += int(skipped)
        return not skipped

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, object]:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if "scaler" not in state:  # a bare GradScaler state (older checkpoints)
            self.scaler.load_state_dict(state)
            return
        self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
        self.skipped_steps = int(state.get("skipped_steps", 0))  # type: ignore[arg-type]


__all__ = [
    "AUTOCAST_DTYPES",
    "DEFAULT_PARITY_TOLERANCE",
    "DEFAULT_PARITY_WINDOW",
    "LossScaler",
    "ParityResult",
    "apply_fp8",
    "autocast",
    "cpu_supports_fp16",
    "parity",
    "resolve_precision",
    "resolve_precision_decision",
]
