"""``apply_kernels``: swap matching submodules of one model instance for kernel modules.

No global monkeypatching: only the instance handed in changes, and each swapped module keeps the
same Parameter objects, so optimizers (built before or after) and state_dict keys are unaffected.
Matching is by exact torch type (a subclass may have its own forward, so it is left alone) or, for
modules slipstream cannot know by type, by a duck-typed class attribute ``slipstream_kernel``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import nn as knn
from .chooser import KEEP, KernelChooser
from .dispatch import resolve_backend

KERNEL_OPS: tuple[str, ...] = (
    "linear_cross_entropy",
    "cross_entropy",
    "rms_norm",
    "layer_norm",
    "swiglu",
    "gelu_tanh",
)

# Hugging Face's Llama-family RMSNorms: weight * (x * rsqrt(mean(x^2) + eps)) in fp32, what ours
# computes. Gemma's (1 + weight) form is deliberately absent: the kernel would compute another function.
HF_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "OlmoRMSNorm"})


@dataclass
class KernelSwapReport:
    """What ``apply_kernels`` did. ``swapped``: op -> modules replaced; ``skipped``: op -> reason;
    ``backends``: op -> the backend installed; ``timings``: op -> the chooser's verdict (auto only)."""

    backend: str
    swapped: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _marker(module: nn.Module) -> str | None:
    return getattr(type(module), "slipstream_kernel", None)


def _own_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


# op -> (matches(module), build(module, backend))
_RULES: dict[str, tuple[Callable[[nn.Module], bool], Callable[[nn.Module, str], nn.Module]]] = {
    "layer_norm": (lambda m: type(m) is nn.LayerNorm, knn.LayerNorm.adopt),
    "rms_norm": (
        lambda m: type(m) is nn.RMSNorm or type(m).__name__ in HF_RMS_NORMS,
        lambda m, b: (
            knn.RMSNorm.adopt(m, b)
            if isinstance(m, nn.RMSNorm)
            else knn.RMSNorm.adopt(
                m, b, normalized_shape=tuple(m.weight.shape), eps=m.variance_epsilon, elementwise_affine=True
            )
        ),
    ),
    "gelu_tanh": (lambda m: type(m) is nn.GELU and m.approximate == "tanh", knn.GeluTanh.adopt),
    "cross_entropy": (
        lambda m: type(m) is nn.CrossEntropyLoss and m.weight is None and m.label_smoothing == 0.0,
        knn.CrossEntropyLoss.adopt,
    ),
    # marked modules are the user's classes: install ours, carrying over only the ignore index
    "swiglu": (
        lambda m: _marker(m) == "swiglu" and not _own_state(m),
        lambda m, b: _fresh(knn.SwiGLU, b),
    ),
    "linear_cross_entropy": (
        lambda m: _marker(m) == "linear_cross_entropy" and not _own_state(m),
        lambda m, b: _fresh(knn.LinearCrossEntropy, b, ignore_index=int(getattr(m, "ignore_index", -100))),
    ),
}

_WHAT = {
    "layer_norm": "nn.LayerNorm",
    "rms_norm": "nn.RMSNorm (or a Llama-family RMSNorm)",
    "gelu_tanh": "nn.GELU(approximate='tanh')",
    "cross_entropy": "nn.CrossEntropyLoss (without class weights or label smoothing)",
    "swiglu": "module marked slipstream_kernel='swiglu' (without parameters)",
    "linear_cross_entropy": "loss head marked slipstream_kernel='linear_cross_entropy' (without parameters)",
}


def _fresh(cls, backend: str, **attrs) -> nn.Module:
    module = cls()
    module.backend = backend
    module.__dict__.update(attrs)
    return module


def parse_ops(ops: str | Sequence[str]) -> tuple[str, ...]:
    """``"off"`` -> (), ``"auto"`` -> all ops, a list -> validated names (ValueError names the valid ones)."""
    if isinstance(ops, str):
        if ops == "off":
            return ()
        if ops == "auto":
            return KERNEL_OPS
        ops = [ops]
    unknown = [op for op in ops if op not in KERNEL_OPS]
    if unknown:
        raise ValueError(
            f"unknown kernel op(s) {unknown}: valid are 'off', 'auto' or a list of {list(KERNEL_OPS)}"
        )
    return tuple(dict.fromkeys(ops))


def active_ops(
    ops: str | Sequence[str],
    backend: str,
    device: torch.device | str,
    report: KernelSwapReport,
    present: Sequence[str],
    model: nn.Module,
    chooser: KernelChooser | None = None,
) -> dict[str, str]:
    """op -> backend for the ops of ``ops`` to swap. Named ops always run on ``backend``. Under
    ``auto`` (ops and backend both) each op in ``present`` is timed against the model's own module
    by ``chooser`` and swapped only where a candidate wins; the verdicts go into ``report``."""
    if not (ops == "auto" and backend == "auto"):
        chosen = resolve_backend(backend, device)
        return {op: chosen for op in parse_ops(ops)}
    verdicts = (chooser or KernelChooser())(model, [op for op in KERNEL_OPS if op in present], device)
    active = {}
    for op, verdict in verdicts.items():
        report.timings[op] = {**verdict.to_dict(), "reason": verdict.reason}
        if verdict.choice == KEEP:
            report.skipped[op] = f"kept the model's own module: {verdict.reason}"
        else:
            active[op] = verdict.choice
    return active


def present_ops(model: nn.Module, ops: Sequence[str]) -> list[str]:
    """The ops of ``ops`` that have a module to swap in ``model``."""
    found = set()
    for child in model.modules():
        if isinstance(child, knn.KernelModule):
            continue
        found.update(op for op in ops if op not in found and _RULES[op][0](child))
    return [op for op in ops if op in found]


def apply_kernels(
    model: nn.Module,
    ops: str | Sequence[str],
    device: torch.device | str,
    backend: str = "auto",
    *,
    chooser: KernelChooser | None = None,
) -> KernelSwapReport:
    """Swap the submodules of ``model`` that match ``ops`` for kernel modules, in place.

    ``ops="auto"`` with ``backend="auto"`` times, per op the model has, our kernel, Liger-Kernel's,
    inductor's and the model's own module at the model's widths on ``device`` (see
    slipstream.kernels.chooser) and swaps only the winners. Named ops or a named backend swap
    exactly that, on any device. Calling twice is harmless (kernel modules are not matched again).
    """
    names = parse_ops(ops)
    if not names:
        return KernelSwapReport(backend="torch")
    report = KernelSwapReport(backend=resolve_backend("auto" if backend == "auto" else backend, device))
    present = present_ops(model, names)
    active = active_ops(ops, backend, device, report, present, model, chooser)
    report.backends = {op: b for op, b in active.items() if op in present}

    replaced: dict[int, tuple[str, nn.Module]] = {}  # id(old) -> (op, new): shared modules stay shared
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or isinstance(child, knn.KernelModule):
                continue
            if id(child) not in replaced:
                op = next((op for op in active if _RULES[op][0](child)), None)
                if op is None:
                    continue
                replaced[id(child)] = (op, _RULES[op][1](child, active[op]))
            parent._modules[name] = replaced[id(child)][1]

    for op, _ in replaced.values():
        report.swapped[op] = report.swapped.get(op, 0) + 1
    for op in names:
        if op not in present:
            report.skipped[op] = f"no {_WHAT[op]} in the model"
    return report
