"""`distributed.strategy=pipeline` in the built-in loop: the GPT split into one stage per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models import unwrap
from ..optimizers import build_param_groups
from ..recipe import RecipeError
from ..session import Session
from .pipeline import PipelineRunner, clip_grad_norm_, split_gpt


@dataclass
class PipelineParts:
    """What one rank of a pipeline trains, and how its checkpoints name it."""

    held: nn.ModuleList
    """This rank's stages."""
    optimizer: torch.optim.Optimizer
    runner: PipelineRunner
    named: dict[str, nn.Parameter]
    """This rank's parameters under their names in the whole GPT (checkpoints are keyed by them)."""
    aliases: dict[str, str]
    """A tied head reads the embedding's state when the checkpoint stored only that."""
    one_process_order: list[str]
    """Names of a one-process optimizer's parameter positions (to resume a checkpoint.pt)."""


def prepare_pipeline(session: Session, model: nn.Module, total_steps: int) -> PipelineParts:
    """This rank's stages, their optimizer, the runner that steps the global batch through all
    ranks, and the names its checkpoints use. Every rank builds the whole model from the same
    seed and keeps its own slice."""
    from ..workloads.gpt import GPT

    cfg = session.recipe.distributed
    env = session.dist
    raw = unwrap(session.prepare_model(model))
    if not isinstance(raw, GPT):
        raise RecipeError(
            f"distributed.strategy=pipeline splits the built-in GPT only, not {type(raw).__name__}; "
            "use ddp or fsdp for your own model"
        )
    if session.precision == "fp16":
        raise RecipeError("distributed.strategy=pipeline does not scale fp16 losses; use bf16 or fp32")
    virtual = 2 if cfg.pipeline_schedule == "interleaved-1f1b" else 1
    try:
        stages = split_gpt(raw, env.world_size, env.rank, virtual=virtual)
        runner = PipelineRunner(
            stages,
            env.rank,
            env.world_size,
            schedule=cfg.pipeline_schedule,
            microbatches=cfg.microbatches,
            pad_rows=True,  # planned batches keep their rows; padding rows carry no targets
        )
    except ValueError as err:  # a layout the model or the ranks cannot take: say it in one line
        raise RecipeError(f"distributed.strategy=pipeline: {err}") from err
    held = nn.ModuleList(stages)
    optimizer = session.build_optimizer(held, total_steps=total_steps)
    session.clip_grad_norm = lambda params, max_norm: clip_grad_norm_(runner, max_norm)
    session.tracker.extra.update(
        world_size=env.world_size,
        distributed_strategy="pipeline",
        pipeline_schedule=cfg.pipeline_schedule,
        pipeline_microbatches=cfg.microbatches,
        pipeline_stages=[s.index for s in stages],
    )
    names = {id(p): n for n, p in raw.named_parameters()}
    groups = build_param_groups(raw, session.recipe.optimizer.weight_decay)
    named = {n: p for stage in stages for n, p in stage.model_named_parameters()}
    return PipelineParts(
        held,
        optimizer,
        runner,
        named,
        aliases={"lm_head.weight": "wte.weight"} if raw.lm_head.weight is raw.wte.weight else {},
        one_process_order=[names[id(p)] for g in groups for p in g["params"]],
    )
