"""Fused kernels: Triton on CUDA, pure torch on CPU, each checked against ``reference``.

Functions take ``backend="auto" | "triton" | "torch" | "liger" | "compile"``; ``apply_kernels`` swaps a
model's modules (under ``auto``, only where a timed candidate beats the module: ``chooser``).
Importing this package never imports Triton (kernels are built on first launch).
"""

from .activations import geglu_tanh, gelu_tanh, swiglu
from .chooser import KernelChooser, OpChoice, choose_kernels, injected_timer
from .cross_entropy import cross_entropy
from .dispatch import poison_outputs, resolve_backend
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .norms import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .swap import KERNEL_OPS, KernelSwapReport, apply_kernels, parse_ops

__all__ = [
    "KERNEL_OPS",
    "KernelChooser",
    "KernelSwapReport",
    "OpChoice",
    "add_layer_norm",
    "add_rms_norm",
    "apply_kernels",
    "choose_kernels",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "geglu_tanh",
    "gelu_tanh",
    "injected_timer",
    "layer_norm",
    "parse_ops",
    "poison_outputs",
    "resolve_backend",
    "rms_norm",
    "swiglu",
]
