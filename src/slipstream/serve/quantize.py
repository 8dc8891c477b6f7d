"""Serving-time quantization via torchao, and the validation-loss delta it costs, measured.

Modes: "none" (the weights as saved: fp32 unless the model was saved in another dtype), "bf16"
(weights cast to bfloat16), "int8-weight-only" (torchao Int8WeightOnlyConfig) and "int8-dynamic"
(Int8DynamicActivationInt8WeightConfig: int8 activations quantised per token at run time). Every linear layer but the LM head is quantised (the built-in GPT's
blocks; a Hugging Face model's attention and MLP projections); the LM head stays in full precision
(it is tied to the input embedding in many models, and quantising it would untie them).
Quantisation changes the model in place (torchao's `quantize_`) — pass a copy to keep the original.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipe import RecipeError
from .model import LoadedModel

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


@torch.inference_mode()
def validation_loss(
    loaded: LoadedModel,
    docs: list[np.ndarray],
    max_len: int,
    runner: Callable | None = None,
    batch_size: int = 8,
) -> float:
    """Mean next-token loss (nats) over the documents' tokens (each truncated to max_len).

    `runner` is the model to run (a quantised copy, or a compiled callable); default loaded.model."""
    runner = runner or loaded.model
    device = next(loaded.model.parameters()).device
    total, count = 0.0, 0
    docs = sorted((d[:max_len] for d in docs if len(d) >= 2), key=len)
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        L = max(len(d) for d in chunk)
        x = torch.full((len(chunk), L), loaded.pad_id, dtype=torch.long)
        y = torch.full((len(chunk), L), -100, dtype=torch.long)
        for j, d in enumerate(chunk):
            t = torch.as_tensor(d, dtype=torch.long)
            x[j, : len(d)] = t
            y[j, : len(d) - 1] = t[1:]
        total += float(loaded.token_nll(runner, x.to(device), y.to(device)).double().sum())
        count += int((y != -100).sum())
    return total / max(count, 1)


@dataclass(frozen=True)
class CastQuality:
    """What casting the served weights cost, measured at start-up (`serve --quantize auto`)."""

    mode: str
    saved_dtype: str
    loss_saved_nats: float
    loss_served_nats: float
    top1_agreement: float
    """Share of positions where the cast model's most likely next token is the saved model's."""
    positions: int
    docs: int

    @property
    def loss_delta_nats(self) -> float:
        return self.loss_served_nats - self.loss_saved_nats

    def to_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "loss_delta_nats": self.loss_delta_nats}

    def describe(self) -> str:
        return (
            f"measured on {self.docs} validation documents ({self.positions:,} positions): validation loss "
            f"{self.loss_delta_nats:+.4f} nats vs the saved {self.saved_dtype} weights "
            f"({self.loss_saved_nats:.4f} -> {self.loss_served_nats:.4f}), greedy next token unchanged at "
            f"{self.top1_agreement:.1%} of positions"
        )


@torch.inference_mode()
def _loss_and_top1(loaded: LoadedModel, docs: list[np.ndarray]) -> tuple[float, list[Tensor], int]:
    """Mean next-token loss (nats) and the argmax token at every position, one document at a time."""
    device = next(loaded.model.parameters()).device
    total, count, top1 = 0.0, 0, []
    for d in docs:
        x = torch.as_tensor(d[:-1], dtype=torch.long, device=device)[None]
        y = torch.as_tensor(d[1:], dtype=torch.long, device=device)
        if loaded.family == "gpt":
            logits = loaded.model(x)[0].float()
        else:
            logits = loaded.model(input_ids=x, use_cache=False).logits[0].float()
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        count += len(y)
        top1.append(logits.argmax(-1))
    return total / max(count, 1), top1, count


def measure_cast(loaded: LoadedModel, mode: str, docs: list[np.ndarray]) -> CastQuality:
    """Quantise `loaded.model` in place to `mode`, measuring the validation loss and the greedy
    next token on `docs` before and after (no copy of the model is made)."""
    before, top_before, positions = _loss_and_top1(loaded, docs)
    quantize_model(loaded.model, mode)
    after, top_after, _ = _loss_and_top1(loaded, docs)
    same = sum(int((a == b).sum()) for a, b in zip(top_before, top_after))
    return CastQuality(
        mode=mode,
        saved_dtype=loaded.saved_dtype,
        loss_saved_nats=before,
        loss_served_nats=after,
        top1_agreement=same / max(positions, 1),
        positions=positions,
        docs=len(docs),
    )


@torch.inference_mode()
def forward_latency_s(
    loaded: LoadedModel, batch: int, length: int, runner: Callable | None = None, reps: int = 5
) -> float:
    """Median seconds of one scoring forward of shape (batch, length), after one warm-up pass."""
    runner = runner or loaded.model
    device = next(loaded.model.parameters()).device
    x = torch.randint(0, min(256, loaded.vocab_size), (batch, length), device=device)
    loaded.token_nll(runner, x, x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loaded.token_nll(runner, x, x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def evaluation_docs(loaded: LoadedModel, data: str | None, n_docs: int) -> list[np.ndarray]:
    """Token documents to measure the loss on: `data` (a text file, .jsonl or folder, as
    `--data` reads it) through the model's tokenizer, else the gpt-stdlib validation split
    (as text through the model's tokenizer for a Hugging Face model)."""
    from pathlib import Path

    from ..workloads.corpus import load_stdlib_corpus

    if data is not None:
        from ..workloads.user_data import read_documents, split_validation

        found = read_documents(Path(data))
        texts = found.validation
        if texts is None:  # the same held-out split `slipstream train --data` keeps out of training
            texts = [t for t, held in zip(found.train, split_validation(found.train)) if held]
        texts = texts[:n_docs]
        return [np.asarray(loaded.codec.encode(t)) for t in texts]
    val = load_stdlib_corpus().validation
    docs = [np.asarray(val[i]) for i in range(min(n_docs, len(val)))]
    if loaded.family == "gpt":
        return docs
    from .text import ByteCodec

    return [np.asarray(loaded.codec.encode(ByteCodec().decode(d.tolist()))) for d in docs]


def quantize_eval(
    workload: str,
    size: str | None,
    checkpoint: str | None,
    modes: list[str],
    *,
    model_dir: str | None = None,
    data: str | None = None,
    n_docs: int = 200,
    max_len: int | None = None,
    shapes: tuple[tuple[int, int], ...] = ((1, 512), (8, 512)),
    reps: int = 5,
    compile: bool = False,
) -> dict:
    """Validation loss and forward latency of each mode vs fp32, interleaved per repetition.

    `model_dir`: a Hugging Face folder (as `serve --model`) instead of the workload's GPT.
    With `compile`, every mode (fp32 included) runs as `slipstream serve --compile` runs it, so
    both the loss delta and the speed-up are those of the compiled server."""
    import copy
    from dataclasses import replace

    from .compiled import compile_for_serving
    from .model import load_hf_model, load_model

    base = load_hf_model(model_dir) if model_dir else load_model(workload, size, checkpoint)
    L = min(max_len or base.max_len, base.max_len)
    docs = evaluation_docs(base, data, n_docs)
    if not docs:
        raise RecipeError(f"--data {data}: no documents to evaluate on")
    models = {"none": base}
    for mode in modes:
        if mode != "none":
            models[mode] = replace(base, model=quantize_model(copy.deepcopy(base.model), mode))
    device = next(base.model.parameters()).device
    runners = {m: compile_for_serving(lm.model, device) if compile else lm.model for m, lm in models.items()}
    losses = {m: validation_loss(models[m], docs, L, run) for m, run in runners.items()}
    shapes = tuple((b, min(n, L)) for b, n in shapes)
    lat: dict[str, dict[str, list[float]]] = {m: {f"{b}x{n}": [] for b, n in shapes} for m in models}
    for _ in range(reps):  # interleaved: mode A, mode B, ..., repeated
        for m, run in runners.items():
            for b, n in shapes:
                lat[m][f"{b}x{n}"].append(forward_latency_s(models[m], b, n, run, reps=1))
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
        "workload": base.workload,
        "size": base.size,
        "checkpoint": base.source,
        "validation_docs": len(docs),
        "data": data or "gpt-stdlib validation split",
        "max_len": L,
        "reps": reps,
        "compiled": compile,
        "torch": torch.__version__,
        "results": rows,
    }
