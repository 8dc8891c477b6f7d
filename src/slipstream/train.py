"""The built-in training loop: Session underneath, progress, validation, exact resume."""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    clean_stale_temps,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from .checkpoint import set_rng_state as restore_rng_state
from .dataflow import PrefetchLoader
from .distributed.checkpoint import (
    DCP_NAME,
    NAMED_LAYOUT,
    dcp_path,
    load_dcp,
    load_full,
    load_named_dcp,
    load_named_full,
    read_meta,
    save_dcp,
    save_named_dcp,
)
from .distributed.env import DistEnv, all_reduce_sum, destroy_process_group, gather_floats, rank_failure
from .metrics import MetricsSummary
from .models import loss_of, unwrap
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
        measured = self.metrics.to_dict()
        # `steps` counts the whole run (a resumed one included); the metrics' count is this process's
        measured["steps_this_run"] = measured.pop("steps", None)
        d.update(measured)
        d.update(d.pop("extra"))
        return d


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: ShapedLoader,
    session: Session,
    batches: int,
    batch_loss: Callable[[Any], torch.Tensor] | None = None,
) -> float:
    """Mean loss per real token over the first `batches` batches of the validation epoch.
    `batch_loss(batch)`: the batch's mean loss when `model(**batch)` cannot give it (pipeline
    stages each hold a slice of the model)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=session.device)
    tokens = 0
    for plan in loader.plans(epoch=0)[:batches]:
        batch = loader.make_batch(plan)
        with session.autocast():
            loss = batch_loss(batch) if batch_loss is not None else loss_of(model(**batch))
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
    if eval_every < 0 or checkpoint_every < 0:
        raise RecipeError(
            f"eval_every={eval_every} and checkpoint_every={checkpoint_every} must be >= 0 (0 = never)"
        )
    if eval_every > 0 and eval_batches < 1:
        raise RecipeError(f"eval_batches={eval_batches} must be at least 1 (or eval_every=0: no validation)")
    if export_dir is not None:
        from .export import check_export_dir

        check_export_dir(export_dir)  # before the run, not after it
    recipe = resolve_recipe(recipe)
    wl = get_workload(workload)
    if size not in wl.sizes:
        raise RecipeError(f"workload {workload!r} has no size {size!r}; choose one of {', '.join(wl.sizes)}")
    env = DistEnv.from_environ()
    folder = Path(checkpoint_dir) if checkpoint_dir else None
    ckpt_path = folder / CHECKPOINT_NAME if folder else None
    if resume and ckpt_path is None:
        raise RecipeError("resume needs a checkpoint folder: pass --checkpoint-dir")
    existing = _existing_checkpoint(folder)
    if existing is not None and env.restart_count > 0:
        resume = True  # torchrun restarted the ranks after a failure: continue from the checkpoint
    if existing is not None and not resume:
        raise CheckpointError(
            f"{existing} already exists; pass --resume to continue it, or choose another --checkpoint-dir"
        )
    saved = None
    if resume:
        if existing is None:
            load_checkpoint(ckpt_path)  # type: ignore[arg-type]  # raises: nothing to resume, and the fix
        saved = (
            read_meta(existing)
            if existing.name == DCP_NAME or existing.is_dir()
            else load_checkpoint(existing)
        )  # type: ignore[union-attr]
    identity = _run_identity(workload, size, recipe)
    if saved is not None:
        _check_identity(saved["identity"], identity, existing)  # type: ignore[arg-type]

    # A resumed run keeps the `auto` choices it made (a new trial could pick another data order).
    earlier = saved["session"].get("decisions") if saved is not None else None  # type: ignore[union-attr]
    session = Session(recipe, decisions=earlier)
    finished = False
    try:
        result = _train(
            session, wl, workload, size, recipe, steps, identity, saved, existing, folder,
            eval_every=eval_every, eval_batches=eval_batches, checkpoint_every=checkpoint_every,
            progress=progress, log_every=log_every, on_eval=on_eval, export_dir=export_dir,
        )  # fmt: skip
        finished = True
        return result
    except (torch.distributed.DistError, RuntimeError) as err:
        if env.active and _is_collective_failure(err):
            raise rank_failure(err, env, recipe.distributed.timeout_s) from err
        raise
    finally:
        session.close()  # process-wide switches (deterministic algorithms) back as they were
        if env.active:
            destroy_process_group(barrier=finished)  # ranks that finished leave together


def _existing_checkpoint(folder: Path | None) -> Path | None:
    """The newest checkpoint in `folder`: one process writes checkpoint.pt, several a DCP folder;
    a run that changed its world size leaves both for a moment (the newer step wins)."""
    if folder is None:
        return None
    pt = folder / CHECKPOINT_NAME
    dcp = dcp_path(folder)
    if dcp is None:
        return pt if pt.exists() else None
    if not pt.exists():
        return dcp
    return dcp if int(read_meta(dcp)["step"]) >= int(load_checkpoint(pt)["step"]) else pt


def _is_collective_failure(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, torch.distributed.DistError) or any(
        k in text for k in ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset", "timed out")
    )


def _train(
    session: Session,
    wl: Any,
    workload: str,
    size: str,
    recipe: Recipe,
    steps: int,
    identity: dict[str, Any],
    saved: dict[str, Any] | None,
    existing: Path | None,
    folder: Path | None,
    *,
    eval_every: int,
    eval_batches: int,
    checkpoint_every: int,
    progress: bool,
    log_every: int,
    on_eval: Callable[[int, float], None] | None,
    export_dir: str | Path | None,
) -> TrainResult:
    from .distributed.balance import LoadBalancer
    from .distributed.wrap import gradient_sync, local_module

    env = session.dist
    dcfg = recipe.distributed
    pipeline = parts = None
    ckpt_path = folder / CHECKPOINT_NAME if folder else None
    data = wl.load_data()
    if env.active and dcfg.strategy == "pipeline":
        from .distributed.pipeline_train import prepare_pipeline

        parts = prepare_pipeline(session, wl.model(size, recipe.shapes.max_len), steps)
        model, optimizer, pipeline = parts.held, parts.optimizer, parts.runner
    else:
        model = session.prepare_model(wl.model(size, recipe.shapes.max_len))
        optimizer = session.build_optimizer(model, total_steps=steps)
    balancer = None
    if wl.make_loaders is not None:  # workloads with their own data pipeline (e.g. decoded images)
        if env.active:
            raise RecipeError(
                f"workload {workload!r} brings its own data pipeline; several ranks train token workloads only"
            )
        loader, val_loader = wl.make_loaders(session, data)
    else:
        loader = session.prepare_step_loader(
            data.train, lengths=data.train_lengths, pad_id=data.pad_id, data_parallel=pipeline is None
        )
        if dcfg.balance != "off" and env.active:
            if dcfg.strategy != "ddp" and dcfg.balance == "on":
                raise RecipeError(
                    "distributed.balance=on needs strategy=ddp (an fsdp forward waits on the other "
                    "ranks, so its time is not this rank's speed); use balance=off or auto"
                )
            if dcfg.strategy == "ddp":
                lead = (recipe.dataflow.prefetch_depth + 2) if recipe.dataflow.prefetch else 1
                shards = loader.loader if isinstance(loader, PrefetchLoader) else loader
                balancer = LoadBalancer(shards, env, dcfg.balance, dcfg.balance_every, lead)
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
        if existing is not None and existing.is_dir():  # a DCP folder: any world size, resharded
            if parts is not None:  # pipeline stages read their slice by parameter name
                load_named_dcp(existing, parts.named, optimizer, parts.aliases)
            elif saved.get("layout") == NAMED_LAYOUT:
                # a pipeline's checkpoint, continued without stages: the whole model reads every name
                load_named_dcp(existing, dict(unwrap(local_module(model)).named_parameters()), optimizer)
            else:
                load_dcp(existing, model, optimizer)
        elif parts is not None:
            load_named_full(saved, parts.named, optimizer, parts.one_process_order, parts.aliases)
        elif env.active:
            load_full(saved, model, optimizer)  # a 1-process checkpoint into N ranks
        else:
            unwrap(model).load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        session.load_state_dict(saved["session"])
        loader.load_state_dict(saved["loader"])
        step = int(saved["step"])
        losses = list(saved["loss"])
        val_losses = list(saved["val_loss"])
        restore_rng_state(saved["rng"])
    if folder is not None and env.is_main:
        # A run killed in its first checkpoint write restarts fresh: its temp goes too.
        clean_stale_temps(folder)
    start_step = step

    def write_checkpoint() -> None:
        if folder is None:
            return
        state = {
            "identity": identity,
            "step": step,
            "session": session.state_dict(),
            "loader": loader.state_dict(),
            "loss": losses,
            "val_loss": val_losses,
            "rng": rng_state(),
        }
        if env.active:
            if parts is not None:
                save_named_dcp(folder, parts.named, optimizer, state, env)
            else:
                save_dcp(folder, model, optimizer, state, env)
            if env.is_main:
                ckpt_path.unlink(missing_ok=True)  # type: ignore[union-attr]  # superseded
            return
        state.update(model=unwrap(model).state_dict(), optimizer=optimizer.state_dict())
        save_checkpoint(ckpt_path, state)  # type: ignore[arg-type]
        shutil.rmtree(folder / DCP_NAME, ignore_errors=True)  # superseded by the 1-process file

    eval_model = local_module(model)
    # Under a pipeline every rank runs each validation batch through the stages, forward only.
    batch_loss = None if pipeline is None else (lambda batch: torch.tensor(pipeline.evaluate(batch)))
    if step == 0 and eval_every > 0:
        val_losses.append(
            {"step": 0, "loss": evaluate(eval_model, val_loader, session, eval_batches, batch_loss)}
        )

    bar = _Progress(steps, step, progress and env.is_main)
    step_lengths: list[float] = []  # row length of each step on this rank: lock-step is checked at the end
    pending: list[torch.Tensor] = []  # losses kept on device until a log point: no sync per step
    t_start = time.perf_counter()
    tokens_seen = 0
    model.train()
    updating = False  # True while parameters may be half-updated: no checkpoint may be taken then
    try:
        batches = loader.forever()
        while step < steps:
            step_loss = None
            while pipeline is not None:  # the global batch, micro-batched through the stages
                batch = next(batches)
                with session.autocast():
                    value = pipeline.step(batch, broadcast_loss=True)
                # every rank holds the loss; rank 0's alone makes the sum over ranks at log points
                step_loss = torch.tensor(float(value) if env.is_main else 0.0, dtype=torch.float64)
                tokens_seen += batch.real_tokens if env.is_main else 0
                if getattr(batch, "step_end", True):
                    break
            while pipeline is None:  # this rank's micro-batches of the step; gradients sync on the last
                batch = next(batches)
                weight = getattr(batch, "weight", 1.0)
                with gradient_sync(model, getattr(batch, "step_end", True)):
                    timed = balancer.timed(*batch.shape, session.device) if balancer else nullcontext()
                    with timed, session.autocast():
                        loss = loss_of(model(**batch))
                    # DDP and FSDP average gradients over ranks: scaled by world_size x this batch's
                    # share of the step's targets, the sum is the token-weighted global gradient.
                    scale = weight * env.world_size
                    session.backward(loss if scale == 1.0 else loss * scale)
                part = loss.detach() if weight == 1.0 else loss.detach() * weight
                step_loss = part if step_loss is None else step_loss + part
                tokens_seen += batch.real_tokens
                if getattr(batch, "step_end", True):
                    break
            step_lengths.append(float(batch.shape[1]))
            updating = True
            session.step(optimizer)
            pending.append(step_loss)
            step += 1
            updating = False
            if balancer is not None:
                balancer.after_step(step)
            at_eval = eval_every > 0 and (step % eval_every == 0 or step == steps)
            at_ckpt = checkpoint_every > 0 and step % checkpoint_every == 0
            if pending and (step % log_every == 0 or at_eval or at_ckpt or step == steps):
                # Each rank holds its share of the step's loss: the sum over ranks is the step's loss.
                losses.extend(all_reduce_sum(torch.stack(pending).double(), env).float().tolist())
                pending.clear()
                if not math.isfinite(losses[-1]):
                    raise FloatingPointError(
                        f"training loss became {losses[-1]} at step {step}; lower optimizer.lr or use fp32/bf16"
                    )
                bar.update(step, losses[-1], tokens_seen / (time.perf_counter() - t_start))
            if at_eval:
                val_losses.append(
                    {
                        "step": step,
                        "loss": evaluate(eval_model, val_loader, session, eval_batches, batch_loss),
                    }
                )
                if on_eval is not None:
                    on_eval(step, val_losses[-1]["loss"])
            if at_ckpt:
                write_checkpoint()
    except KeyboardInterrupt:
        if pending and not env.active:
            losses.extend(torch.stack(pending).float().tolist())
        if not updating and not env.active:  # ranks may be mid-collective: no DCP save now
            write_checkpoint()  # keep what was learned; --resume continues from here
        raise
    finally:
        bar.close()
        close = getattr(loader, "close", None)
        if close is not None:
            close()  # join prefetch threads and workers now, not at garbage collection
    write_checkpoint()
    metrics = session.metrics()
    if env.active:
        metrics.extra.update(_rank_figures(env, step_lengths, tokens_seen, time.perf_counter() - t_start))
    if balancer is not None:
        metrics.extra.update(balancer.describe())
    result = TrainResult(
        workload=workload,
        size=size,
        recipe=recipe.to_dict(),
        steps=step,
        loss=losses,
        val_loss=val_losses,
        metrics=metrics,
        checkpoint=str(ckpt_path) if ckpt_path else None,
        resumed_from_step=start_step if saved is not None else None,
        parameters=sum(p.numel() for p in unwrap(local_module(model)).parameters()),
        extra={"rank": env.rank, "world_size": env.world_size},
    )
    if export_dir is not None:  # the trained model (+ tokenizer), loadable without slipstream's loop
        from .export import export_workload_model

        export_workload_model(model, export_dir, workload)
    return result


def _rank_figures(env: DistEnv, step_lengths: list[float], tokens: int, seconds: float) -> dict[str, Any]:
    """Across ranks: steps whose row length differed (lock-step: 0), and aggregate real tokens/s."""
    shapes = gather_floats(step_lengths, env)
    mismatched = sum(len(set(at_step)) > 1 for at_step in zip(*shapes))
    per_rank = gather_floats([tokens / max(seconds, 1e-9), float(tokens)], env)
    return {
        "lockstep_mismatched_steps": mismatched,
        "rank_real_tokens_per_s": [round(r[0], 1) for r in per_rank],
        "global_real_tokens_per_s": round(sum(r[1] for r in per_rank) / max(seconds, 1e-9), 1),
    }
