"""Serving-time quantization via torchao, and the validation-loss delta it costs, measured.

Modes: "none" (fp32), "bf16" (weights cast to bfloat16), "int8-weight-only" (torchao
Int8WeightOnlyConfig) and "int8-dynamic" (Int8DynamicActivationInt8WeightConfig: int8 activations
quantised per token at run time). Every linear layer but the LM head is quantised (the built-in GPT's
blocks; a Hugging Face model's attention and MLP projections); the LM head stays in full precision
(it is tied to the input embedding in many models, and quantising it would untie them).
Quantisation changes the model in place (torchao's `quantize_`) — pass a copy to keep the original.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from torch import nn

from ..recipe import RecipeError

QuantMode = Literal["none", "bf16", "int8-weight-only", "int8-dynamic"]
QUANT_MODES: tuple[str, ...] = ("none", "bf16", "int8-weight-only", "int8-dynamic")


def _output_head(model: nn.Module) -> nn.Module | None:
    """The LM head (tied to the input embedding in GPT-2-style models): kept in full precision."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else getattr(model, "lm_head", None)


def _body_linears(model: nn.Module):
    head = _output_head(model)
    return lambda module, fqn: isinstance(module, nn.Linear) and module is not head


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Quantise `model` in place for inference; returns it."""
    if mode not in QUANT_MODES:
        raise RecipeError(f"--quantize {mode!r}: choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    if mode == "bf16":
        return model.to(torch.bfloat16)
    try:
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
    except ImportError as err:
        raise RecipeError(
            f"--quantize {mode} needs torchao: pip install 'slipstream[quant]' ({err})"
        ) from err
    config = Int8WeightOnlyConfig() if mode == "int8-weight-only" else Int8DynamicActivationInt8WeightConfig()
    quantize_(model, config, filter_fn=_body_linears(model))
    return model


def _device(model: nn.Module | Callable, device: torch.device | None) -> torch.device:
    return device if device is not None else next(model.parameters()).device


@torch.inference_mode()
def validation_loss(
    model: nn.Module | Callable,
    docs: list[np.ndarray],
    max_len: int,
    batch_size: int = 8,
    device: torch.device | None = None,
) -> float:
    """Mean next-token loss (nats) over the documents' tokens (each truncated to max_len).

    `model` may be a compiled callable; then `device` says where its inputs go."""
    device = _device(model, device)
    total, count = 0.0, 0
    docs = sorted((d[:max_len] for d in docs if len(d) >= 2), key=len)
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        L = max(len(d) for d in chunk)
        x = torch.full((len(chunk), L), 258, dtype=torch.long)
        y = torch.full((len(chunk), L), -100, dtype=torch.long)
        for j, d in enumerate(chunk):
            t = torch.as_tensor(d, dtype=torch.long)
            x[j, : len(d)] = t
            y[j, : len(d) - 1] = t[1:]
        loss = model(x.to(device), labels=y.to(device), reduction="sum")
        total += float(loss)
        count += int((y != -100).sum())
    return total / max(count, 1)


@torch.inference_mode()
def forward_latency_s(
    model: nn.Module | Callable, batch: int, length: int, reps: int = 5, device: torch.device | None = None
) -> float:
    """Median seconds of one scoring forward of shape (batch, length), after one warm-up pass."""
    device = _device(model, device)
    x = torch.randint(0, 256, (batch, length), device=device)
    model(x, labels=x, reduction="none")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(x, labels=x, reduction="none")
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quantize_eval(
    workload: str,
    size: str | None,
    checkpoint: str | None,
    modes: list[str],
    *,
    n_docs: int = 200,
    max_len: int | None = None,
    shapes: tuple[tuple[int, int], ...] = ((1, 512), (8, 512)),
    reps: int = 5,
    compile: bool = False,
) -> dict:
    """Validation loss and forward latency of each mode vs fp32, interleaved per repetition.

    With `compile`, every mode (fp32 included) runs as `slipstream serve --compile` runs it, so
    both the loss delta and the speed-up are those of the compiled server."""
    import copy

    from ..workloads.corpus import load_stdlib_corpus
    from .compiled import compile_for_serving
    from .model import load_model

    base = load_model(workload, size, checkpoint)
    L = min(max_len or base.max_len, base.max_len)
    val = load_stdlib_corpus().validation
    docs = [np.asarray(val[i]) for i in range(min(n_docs, len(val)))]
    models = {"none": base.model}
    for mode in modes:
        if mode != "none":
            models[mode] = quantize_model(copy.deepcopy(base.model), mode)
    device = next(base.model.parameters()).device
    runners = {m: compile_for_serving(model, device) if compile else model for m, model in models.items()}
    losses = {m: validation_loss(run, docs, L, device=device) for m, run in runners.items()}
    lat: dict[str, dict[str, list[float]]] = {m: {f"{b}x{n}": [] for b, n in shapes} for m in models}
    for _ in range(reps):  # interleaved: mode A, mode B, ..., repeated
        for m, run in runners.items():
            for b, n in shapes:
                lat[m][f"{b}x{n}"].append(forward_latency_s(run, b, min(n, L), reps=1, device=device))
    rows = []
    for m in models:
        row = {
            "mode": m,
            "validation_loss_nats": losses[m],
            "loss_delta_vs_fp32_nats": losses[m] - losses["none"],
        }
        for key, ts in lat[m].items():
            med = statistics.median(ts)
            row[f"latency_{key}_median_s"] = med
            row[f"speedup_{key}_vs_fp32"] = statistics.median(lat["none"][key]) / med
        rows.append(row)
    return {
        "workload": workload,
        "size": base.size,
        "checkpoint": base.source,
        "validation_docs": len(docs),
        "max_len": L,
        "reps": reps,
        "compiled": compile,
        "torch": torch.__version__,
        "results": rows,
    }
