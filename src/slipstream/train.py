"""The built-in training loop: Session underneath, progress, validation, exact resume."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    clean_stale_temps,
    fault_point,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from .checkpoint import set_rng_state as restore_rng_state
from .metrics import MetricsSummary
from .models import loss_of
from .presets import resolve_recipe
from .recipe import Recipe, RecipeError
from .session import Session
from .shapes.loader import ShapedLoader
from .workloads import get_workload


@dataclass
class TrainResult:
    workload: str
    size: str
    recipe: dict[str, Any]
    steps: int
    loss: list[float]
    """Training loss of every step from step 1 (resumed runs include the steps before the resume)."""
    val_loss: list[dict[str, float]]
    """Token-weighted validation loss: [{"step": s, "loss": l}, ...], step 0 is before training."""
    metrics: MetricsSummary
    checkpoint: str | None = None
    resumed_from_step: int | None = None
    parameters: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("metrics")
        d.update(self.metrics.to_dict())
        d.update(d.pop("extra"))
        return d


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShapedLoader, session: Session, batches: int) -> float:
    """Mean loss per real token over the first `batches` batches of the validation epoch."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=session.device)
    tokens = 0
    for plan in loader.plans(epoch=0)[:batches]:
        batch = loader.make_batch(plan)
        with session.autocast():
            loss = loss_of(model(**batch))
        total += loss.double() * batch.real_tokens  # mean loss x real tokens = exact token-weighted sum
        tokens += batch.real_tokens
    model.train(was_training)
    return float(total.item() / max(tokens, 1))


def _run_identity(workload: str, size: str, recipe: Recipe) -> dict[str, Any]:
    return {"workload": workload, "size": size, "recipe": recipe.to_dict()}


def _check_identity(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    diffs = []
    for key in ("workload", "size"):
        if saved.get(key) != now[key]:
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, now {now[key]!r}")
    old, new = saved.get("recipe", {}), now["recipe"]
    for sec in sorted(set(old) | set(new)):
        if sec == "name":
            continue
        a, b = old.get(sec), new.get(sec)
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    diffs.append(f"{sec}.{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}")
        elif a != b:
            diffs.append(f"{sec}: checkpoint {a!r}, now {b!r}")
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run ({'; '.join(diffs)}); "
            "resume with the same workload, size and recipe, or use a new --checkpoint-dir"
        )


class _Progress:
    """A rich progress bar when attached to a terminal; quiet otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} real tok/s"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss="-", tps="-")
            self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train(
    workload: str = "gpt-stdlib",
    recipe: str | Recipe = "baseline",
    steps: int = 100,
    *,
    size: str = "tiny",
    eval_every: int = 50,
    eval_batches: int = 4,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    progress: bool = True,
    log_every: int = 10,
    on_eval: Callable[[int, float], None] | None = None,
    export_dir: str | Path | None = None,
) -> TrainResult:
    """Train a registered workload for `steps` optimizer steps under `recipe`.

    With `checkpoint_dir`, a checkpoint is written every `checkpoint_every` steps (and at the end,
    and on Ctrl-C); `resume=True` continues from it with identical data order, RNG and optimizer
    state, so the per-step losses match an uninterrupted run. `on_eval(step, val_loss)` is called
    after each validation (the tuner prunes trials from it; raising there stops the run).
    `export_dir`: write the trained model there at the end (slipstream.export.export_model).
    """
    if steps < 1:
        raise RecipeError(f"steps={steps} must be at least 1")
    recipe = resolve_recipe(recipe)
    wl = get_workload(workload)
    if size not in wl.sizes:
        raise RecipeError(f"workload {workload!r} has no size {size!r}; choose one of {', '.join(wl.sizes)}")
    ckpt_path = Path(checkpoint_dir) / CHECKPOINT_NAME if checkpoint_dir else None
    if resume and ckpt_path is None:
        raise RecipeError("resume needs a checkpoint folder: pass --checkpoint-dir")
    if ckpt_path is not None and ckpt_path.exists() and not resume:
        raise CheckpointError(
            f"{ckpt_path} already exists; pass --resume to continue it, or choose another --checkpoint-dir"
        )
    saved = load_checkpoint(ckpt_path) if resume and ckpt_path is not None else None
    identity = _run_identity(workload, size, recipe)
    if saved is not None:
        _check_identity(saved["identity"], identity, ckpt_path)  # type: ignore[arg-type]

    # A resumed run keeps the `auto` choices it made (a new trial could pick another data order).
    earlier = saved["session"].get("decisions") if saved is not None else None  # type: ignore[union-attr]
    session = Session(recipe, decisions=earlier)
    data = wl.load_data()
    model = session.prepare_model(wl.model(size, recipe.shapes.max_len))
    optimizer = session.build_optimizer(model, total_steps=steps)
    if wl.make_loaders is not None:  # workloads with their own data pipeline (e.g. decoded images)
        loader, val_loader = wl.make_loaders(session, data)
    else:
        loader = session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
        val_loader = ShapedLoader(
            data.validation,
            loader.cfg,
            seed=0,
            device=session.device,
            pad_id=data.pad_id,
            lengths=data.validation_lengths,
            convention=session.convention,
        )

    losses: list[float] = []
    val_losses: list[dict[str, float]] = []
    step = 0
    if saved is not None:
        _raw_model(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        session.load_state_dict(saved["session"])
        loader.load_state_dict(saved["loader"])
        step = int(saved["step"])
        losses = list(saved["loss"])
        val_losses = list(saved["val_loss"])
        restore_rng_state(saved["rng"])
        clean_stale_temps(ckpt_path.parent)  # type: ignore[union-attr]
    start_step = step

    def write_checkpoint() -> None:
        if ckpt_path is None:
            return
        save_checkpoint(
            ckpt_path,
            {
                "identity": identity,
                "step": step,
                "model": _raw_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "session": session.state_dict(),
                "loader": loader.state_dict(),
                "loss": losses,
                "val_loss": val_losses,
                "rng": rng_state(),
            },
        )

    if step == 0 and eval_every > 0:
        val_losses.append({"step": 0, "loss": evaluate(model, val_loader, session, eval_batches)})

    bar = _Progress(steps, step, progress)
    pending: list[torch.Tensor] = []  # losses kept on device until a log point: no sync per step
    t_start = time.perf_counter()
    tokens_seen = 0
    model.train()
    updating = False  # True while parameters may be half-updated: no checkpoint may be taken then
    try:
        batches = loader.forever()
        while step < steps:
            batch = next(batches)
            with session.autocast():
                loss = loss_of(model(**batch))
            session.backward(loss)
            updating = True
            session.step(optimizer)
            pending.append(loss.detach())
            tokens_seen += batch.real_tokens
            step += 1
            updating = False
            at_eval = eval_every > 0 and (step % eval_every == 0 or step == steps)
            at_ckpt = checkpoint_every > 0 and step % checkpoint_every == 0
            if pending and (step % log_every == 0 or at_eval or at_ckpt or step == steps):
                losses.extend(torch.stack(pending).float().tolist())
                pending.clear()
                if not math.isfinite(losses[-1]):
                    raise FloatingPointError(
                        f"training loss became {losses[-1]} at step {step}; lower optimizer.lr or use fp32/bf16"
                    )
                bar.update(step, losses[-1], tokens_seen / (time.perf_counter() - t_start))
            if at_eval:
                val_losses.append({"step": step, "loss": evaluate(model, val_loader, session, eval_batches)})
                if on_eval is not None:
                    on_eval(step, val_losses[-1]["loss"])
            if at_ckpt:
                write_checkpoint()
            fault_point("step")
    except KeyboardInterrupt:
        if pending:
            losses.extend(torch.stack(pending).float().tolist())
        if not updating:
            write_checkpoint()  # keep what was learned; --resume continues from here
        raise
    finally:
        bar.close()
        close = getattr(loader, "close", None)
        if close is not None:
            close()  # join prefetch threads and workers now, not at garbage collection
    write_checkpoint()
    result = TrainResult(
        workload=workload,
        size=size,
        recipe=recipe.to_dict(),
        steps=step,
        loss=losses,
        val_loss=val_losses,
        metrics=session.metrics(),
        checkpoint=str(ckpt_path) if ckpt_path else None,
        resumed_from_step=start_step if saved is not None else None,
        parameters=sum(p.numel() for p in _raw_model(model).parameters()),
    )
    if export_dir is not None:  # the trained model (+ tokenizer), loadable without slipstream's loop
        from .export import export_workload_model

        export_workload_model(model, export_dir, workload)
    return result


def _raw_model(model: nn.Module) -> nn.Module:
    """The module whose state_dict keys are stable (torch.compile's wrapper adds a prefix)."""
    return getattr(model, "_orig_mod", model)
