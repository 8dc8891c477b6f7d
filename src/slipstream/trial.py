"""Short measured trials on the user's own model, for the `auto` choices a matmul figure cannot make.

`optimizer.impl=auto` is another: torch's fused AdamW is one kernel per step on CUDA and usually
wins there, but on a CPU fused and foreach trade places with the parameters' count and sizes, so
both are timed on copies of the model's parameters.

`shapes.mode=auto` is one: packing wastes almost no positions but makes attention document-masked
(on CPUs SDPA with a block-diagonal mask measured ~1.45x slower than `is_causal`), while buckets pad
~7% but keep plain causal attention. Which wins depends on the model, the data and the machine
(bucket 2.02x vs pack 1.56x over baseline on an AVX2 host; 2.00x vs 1.69x on an AMX host), so
Session times one forward+backward per planned shape and weighs each by how often the epoch uses it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .models import loss_of
from .recipe import RecipeError
from .shapes.loader import Batch, ShapedLoader

SLICE_TOKENS = 1024
"""Rows timed per shape: enough rows for about this many positions (a big batch is timed on a
slice and scaled; per-token cost is flat in rows once a slice is this large)."""


class TrialError(RuntimeError):
    """The model could not be timed (its forward does not return a loss); the caller falls back."""


@dataclass
class LoaderTiming:
    real_tokens_per_s: float
    """Estimated over one epoch: real tokens / sum over shapes of (batches x time per batch)."""
    shapes: int
    timed_steps: int
    seconds: float


def _loss_of(out: object) -> torch.Tensor:
    try:
        return loss_of(out)
    except RecipeError as err:
        raise TrialError(f"cannot time a training step: {err}") from err


@contextlib.contextmanager
def _untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Leave no trace of the trial: gradients and every RNG stream as they were."""
    grads = {p: p.grad for p in model.parameters()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for p, g in grads.items():
                p.grad = g


def _slice(batch: Batch, rows: int) -> dict[str, torch.Tensor]:
    return {k: v[:rows] for k, v in batch.items()}


def time_loaders(
    model: nn.Module,
    loaders: dict[str, ShapedLoader],
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
    passes: int = 2,
) -> dict[str, LoaderTiming]:
    """Estimated real tokens/s of training `model` on each loader's epoch.

    Each distinct planned shape is timed on a slice of about SLICE_TOKENS positions and weighed by
    how many batches of the epoch have it. The loaders are timed in alternating passes (A B A B,
    after one untimed warm-up step) and each shape keeps its best time, so a burst of load from
    another process on a shared machine skews neither side."""
    groups: dict[str, dict[tuple[int, int], list]] = {}
    real: dict[str, int] = {}
    for name, loader in loaders.items():
        plans = loader.plans(epoch=0)
        by_shape: dict[tuple[int, int], list] = {}
        for plan in plans:
            by_shape.setdefault(plan.shape, []).append(plan)
        groups[name] = by_shape
        real[name] = sum(sum(len(s) for row in p.rows for s in row) for p in plans)
    best: dict[tuple[str, tuple[int, int]], float] = {}
    batches: dict[tuple[str, tuple[int, int]], dict[str, torch.Tensor]] = {}
    spent = dict.fromkeys(loaders, 0.0)
    steps = dict.fromkeys(loaders, 0)

    def step(batch: dict[str, torch.Tensor]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast():
            loss = _loss_of(model(**batch))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    with _untouched(model, device):
        for p in range(passes):
            for name, loader in loaders.items():
                t_start = time.perf_counter()
                for shape, group in groups[name].items():
                    key = (name, shape)
                    if key not in batches:
                        rows = max(1, min(shape[0], math.ceil(SLICE_TOKENS / shape[1])))
                        batches[key] = _slice(loader.make_batch(group[0]), rows)
                        if p == 0 and len(batches) == 1:
                            step(batches[key])  # the first step allocates and warms caches
                    best[key] = min(best.get(key, math.inf), step(batches[key]))
                    steps[name] += 1
                spent[name] += time.perf_counter() - t_start
    out = {}
    for name, by_shape in groups.items():
        epoch_s = 0.0
        for shape, group in by_shape.items():
            rows = next(iter(batches[(name, shape)].values())).shape[0]
            epoch_s += best[(name, shape)] * (shape[0] / rows) * len(group)
        out[name] = LoaderTiming(real[name] / epoch_s, len(by_shape), steps[name], spent[name])
    return out


OPTIMIZER_TRIAL_BYTES = 512 * 2**20
"""Parameters up to this size are copied to time optimizer implementations; larger models keep
torch's default rather than double their memory for a trial."""


def time_optimizer_impls(
    params: list[torch.Tensor],
    make: Callable[[list[torch.Tensor], str], torch.optim.Optimizer],
    impls: tuple[str, ...] = ("fused", "for-loop", "foreach"),
    steps: int = 3,
) -> dict[str, float] | None:
    """Seconds per optimizer step for each implementation, timed on copies of `params` with random
    gradients (the user's parameters and optimizer are never touched): the best of `steps` after
    one warm-up step. An implementation whose warm-up step is already 5x slower than the best so far
    is not repeated (its warm-up time stands). None when the copies would be too large."""
    if sum(p.numel() * p.element_size() for p in params) > OPTIMIZER_TRIAL_BYTES:
        return None
    out: dict[str, float] = {}
    sync = torch.cuda.synchronize if params and params[0].is_cuda else (lambda: None)
    with torch.random.fork_rng(devices=[]):
        for impl in impls:
            copies = [torch.zeros_like(p, requires_grad=True) for p in params]
            for c in copies:
                c.grad = torch.randn_like(c)
            try:
                opt = make(copies, impl)
                sync()
                t0 = time.perf_counter()
                opt.step()  # the warm-up: allocates the moment buffers
                sync()
            except (RuntimeError, TypeError):  # an implementation this device or dtype lacks
                continue
            best = time.perf_counter() - t0
            if out and best > 5 * min(out.values()):
                out[impl] = best
                continue
            best = math.inf
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                best = min(best, time.perf_counter() - t0)
            out[impl] = best
    return out


__all__ = [
    "OPTIMIZER_TRIAL_BYTES",
    "SLICE_TOKENS",
    "LoaderTiming",
    "TrialError",
    "time_loaders",
    "time_optimizer_impls",
]
