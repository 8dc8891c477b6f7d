"""`distributed.strategy=pipeline` in the built-in loop: the GPT split into one stage per rank."""

from __future__ import annotations

import torch
from torch import nn

from ..recipe import RecipeError
from ..session import Session
from .pipeline import PipelineRunner, clip_grad_norm_, split_gpt


def prepare_pipeline(
    session: Session, model: nn.Module, total_steps: int
) -> tuple[nn.ModuleList, torch.optim.Optimizer, PipelineRunner]:
    """This rank's stages, their optimizer, and the runner that steps the global batch through
    all ranks. Every rank builds the whole model from the same seed and keeps its own slice."""
    from ..workloads.gpt import GPT

    cfg = session.recipe.distributed
    env = session.dist
    raw = getattr(session.prepare_model(model), "_orig_mod", model)
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
    return held, optimizer, runner
