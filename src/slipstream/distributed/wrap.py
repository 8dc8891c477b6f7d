"""Wrap a prepared model for several ranks: DDP, or FSDP2 `fully_shard` per block then the root."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..models import unwrap
from ..recipe import DistributedConfig, RecipeError
from .env import DistEnv


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one (so only one block's parameters are gathered at
    a time): the built-in GPT's `blocks`, a Hugging Face model's decoder layers."""
    raw = unwrap(model)
    for path in ("blocks", "model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: object = raw
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj):
            return list(obj)
    return []


def apply_data_parallel(
    model: nn.Module, cfg: DistributedConfig, env: DistEnv, device: torch.device, precision: str
) -> nn.Module:
    """The model as the strategy runs it (unchanged in one process)."""
    if not env.active:
        return model
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # No buffers to broadcast per forward: ranks start from one seed and keep buffers in step,
        # and a forward without collectives is what the load balancer times.
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False
        )
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # Gather parameters in the compute dtype (half the traffic), reduce gradients in fp32.
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        blocks = transformer_blocks(model)
        for block in blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(unwrap(model), mp_policy=policy)
        return model
    raise RecipeError(
        f"distributed.strategy={cfg.strategy} is run by slipstream.distributed.pipeline, not wrapped; "
        "use ddp or fsdp here"
    )


def is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Accumulate locally (no all-reduce / reduce-scatter) unless `sync`: the last micro-batch of
    a step syncs the sum of all of them once."""
    if sync:
        yield
    elif is_ddp(model):
        with model.no_sync():  # type: ignore[operator]
            yield
    elif hasattr(fsdp := unwrap(model), "set_requires_gradient_sync"):
        fsdp.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(True)  # type: ignore[operator]
    else:
        yield


def local_module(model: nn.Module) -> nn.Module:
    """What each rank runs for evaluation: DDP's inner module (no collectives); FSDP itself (its
    forward gathers the shards, so every rank evaluates together)."""
    return model.module if is_ddp(model) else model  # type: ignore[return-value]
