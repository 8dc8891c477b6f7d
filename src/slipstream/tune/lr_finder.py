"""Learning-rate range test (Leslie Smith, 2015; fastai's `lr_find`).

Train for a few steps while the learning rate grows exponentially from `start_lr` to `end_lr`,
smooth the loss with a bias-corrected exponential moving average, stop when the smoothed loss
exceeds `diverge_factor` x its minimum (or turns non-finite), and suggest a learning rate.

The suggestion rule (stated in the result as `rule`): the learning rate where the smoothed loss
falls fastest against log(lr), searched between the first 10% of the sweep and the minimum of the
smoothed loss ("steepest"). When the loss never falls there is no steepest point and the rule is
"minimum / 10" (the learning rate of the smallest smoothed loss, divided by ten). Both figures are
in the result.

`lr_find` restores the model's parameters and buffers, the optimizer's state (and its learning
rates) and torch's RNG afterwards, so it can run before training the same model.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..files import atomic_write_bytes
from ..models import loss_of
from ..recipe import Recipe, RecipeError


@dataclass
class LRFindResult:
    lrs: list[float]
    """Learning rate of each step of the sweep."""
    losses: list[float]
    """Raw training loss of each step."""
    smoothed: list[float]
    """Bias-corrected exponential moving average of the loss."""
    suggested_lr: float
    """The learning rate the rule picks."""
    rule: str
    """How suggested_lr was picked: 'steepest' or 'minimum / 10'."""
    min_loss_lr: float
    """Learning rate at the smallest smoothed loss."""
    steepest_lr: float | None
    """Learning rate of the steepest fall of the smoothed loss (None when the loss never fell)."""
    stop_reason: str
    """'end of sweep', 'diverged' (smoothed loss > diverge_factor x minimum) or 'non-finite loss'."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def range_test(
    step: Callable[[float], float],
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    beta: float = 0.98,
    diverge_factor: float = 4.0,
) -> LRFindResult:
    """Run `step(lr) -> loss` at exponentially growing learning rates and pick one.

    The core of the test, free of models: `lr_find` wraps a model and optimizer around it."""
    if not 0 < start_lr < end_lr:
        raise RecipeError(f"lr range test needs 0 < start_lr < end_lr, got {start_lr} and {end_lr}")
    if num_steps < 5:
        raise RecipeError(f"lr range test needs at least 5 steps, got {num_steps}")
    ratio = (end_lr / start_lr) ** (1.0 / (num_steps - 1))
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg, best = 0.0, math.inf
    stop_reason = "end of sweep"
    for i in range(num_steps):
        lr = start_lr * ratio**i
        loss = float(step(lr))
        if not math.isfinite(loss):
            stop_reason = "non-finite loss"
            break
        avg = beta * avg + (1.0 - beta) * loss
        s = avg / (1.0 - beta ** (i + 1))
        lrs.append(lr)
        losses.append(loss)
        smoothed.append(s)
        best = min(best, s)
        if i > 0 and s > diverge_factor * best:
            stop_reason = "diverged"
            break
    if not smoothed:
        raise RecipeError(f"the loss was not finite even at start_lr={start_lr}; lower it")
    return _suggest(lrs, losses, smoothed, stop_reason)


def _suggest(lrs: list[float], losses: list[float], smoothed: list[float], stop_reason: str) -> LRFindResult:
    s = np.asarray(smoothed)
    i_min = int(np.argmin(s))
    min_loss_lr = lrs[i_min]
    skip = len(s) // 10  # the average is still settling at the start
    steepest_lr = None
    if i_min - skip >= 2:
        grad = np.gradient(s[skip : i_min + 1], np.log(np.asarray(lrs[skip : i_min + 1])))
        j = int(np.argmin(grad))
        if grad[j] < 0:
            steepest_lr = lrs[skip + j]
    if steepest_lr is not None:
        suggested, rule = steepest_lr, "steepest"
    else:
        suggested, rule = min_loss_lr / 10.0, "minimum / 10"
    return LRFindResult(lrs, losses, smoothed, suggested, rule, min_loss_lr, steepest_lr, stop_reason)


def lr_find(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    session: Any = None,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    beta: float = 0.98,
    diverge_factor: float = 4.0,
) -> LRFindResult:
    """Range test on your model and optimizer; both are restored afterwards.

    `batches` is cycled if shorter than the sweep. Each step computes `loss_fn(model, batch)`
    (default: `model(**batch)` for a dict batch, else `model(batch)`). With a slipstream `session`,
    steps go through its autocast, backward and step (loss scaling, gradient clipping as in training).
    """
    model_state = copy.deepcopy(model.state_dict())
    optim_state = copy.deepcopy(optimizer.state_dict())
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    stream = _cycle(batches)

    def compute(batch: Any) -> torch.Tensor:
        if loss_fn is not None:
            return loss_fn(model, batch)
        return loss_of(model(**batch) if isinstance(batch, dict) else model(batch))

    def step(lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(stream)
        if session is not None:
            with session.autocast():
                loss = compute(batch)
            session.backward(loss)
            session.step(optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = compute(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    model.train()
    try:
        return range_test(
            step,
            start_lr=start_lr,
            end_lr=end_lr,
            num_steps=num_steps,
            beta=beta,
            diverge_factor=diverge_factor,
        )
    finally:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(was_training)


def _cycle(batches: Iterable[Any]) -> Iterator[Any]:
    seen = []
    for b in batches:
        seen.append(b)
        yield b
    if not seen:
        raise RecipeError("lr range test got no batches")
    while True:
        yield from seen


def lr_find_workload(
    workload: str = "gpt-stdlib",
    recipe: str | Recipe = "baseline",
    *,
    size: str = "tiny",
    start_lr: float = 1e-6,
    end_lr: float = 1.0,
    num_steps: int = 100,
    beta: float = 0.98,
    diverge_factor: float = 4.0,
) -> LRFindResult:
    """Range test on a registered workload, under the recipe's shapes, precision and clipping."""
    from ..presets import resolve_recipe
    from ..session import Session, build_optimizer
    from ..workloads import get_workload

    recipe = resolve_recipe(recipe)
    wl = get_workload(workload)
    session = Session(recipe)
    data = wl.load_data()
    model = session.prepare_model(wl.model(size, recipe.shapes.max_len))
    # The free build_optimizer: no warm-up scheduler may fight the sweep over the learning rate.
    optimizer = build_optimizer(model, recipe.optimizer, session.device)
    loader = session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
    batches = loader.forever()
    return lr_find(
        model,
        optimizer,
        (next(batches) for _ in range(num_steps)),
        session=session,
        start_lr=start_lr,
        end_lr=end_lr,
        num_steps=num_steps,
        beta=beta,
        diverge_factor=diverge_factor,
    )


def plot_lr_find(result: LRFindResult, path: str | Path) -> Path:
    """Loss and smoothed loss against the learning rate (log axis), suggestion marked; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result.lrs, result.losses, alpha=0.3, label="loss")
    ax.plot(result.lrs, result.smoothed, label="smoothed loss")
    ax.axvline(
        result.suggested_lr, color="C3", ls="--", label=f"suggested {result.suggested_lr:.2e} ({result.rule})"
    )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"learning-rate range test ({result.stop_reason})")
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=out.suffix[1:] or "png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())  # a kill or a full disk never leaves a torn image
    return out


__all__ = ["LRFindResult", "lr_find", "lr_find_workload", "plot_lr_find", "range_test"]
