"""Checkpoints of several ranks with torch.distributed.checkpoint (DCP), resharded on load.

Each rank writes its own shards in parallel into a folder; rank 0 adds the run's small state
(step, losses, loader position, RNG) as `meta.pt`. The folder is written under a temporary name
and renamed into place, so a crash leaves the previous checkpoint or the new one. Loading works
at any world size: DCP reads whatever slices this rank's (sharded or whole) tensors need, so a
2-rank checkpoint resumes in 1 process and the other way round. A 1-process `checkpoint.pt` is
read by N ranks through the full-state-dict path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import CHECKPOINT_FORMAT, CheckpointError
from .env import DistEnv

DCP_NAME = "checkpoint.dcp"
META_NAME = "meta.pt"


def dcp_path(folder: Path) -> Path | None:
    """The committed DCP checkpoint in `folder` (a crash between the two renames leaves `.old`)."""
    for name in (DCP_NAME, f".{DCP_NAME}.old"):
        path = Path(folder) / name
        if (path / META_NAME).exists():
            return path
    return None


def _barrier(env: DistEnv) -> None:
    if env.active and dist.is_initialized():
        dist.barrier()


def save_dcp(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any], env: DistEnv
) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    final, tmp, old = folder / DCP_NAME, folder / f".{DCP_NAME}.tmp", folder / f".{DCP_NAME}.old"
    if env.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(env)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if env.is_main:
        with open(tmp / META_NAME, "wb") as fh:
            torch.save({"format": CHECKPOINT_FORMAT, "world_size": env.world_size, **meta}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(folder)
    _barrier(env)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = torch.load(Path(path) / META_NAME, map_location="cpu", weights_only=True)
    except Exception as err:  # damaged, truncated, or not ours
        raise CheckpointError(
            f"checkpoint {path} is damaged ({type(err).__name__}); restore it or start a fresh run"
        ) from err
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has an unknown format; it was written by another version")
    return meta


def load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state into this rank's (wrapped or plain) model, resharding."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full(saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A 1-process checkpoint (full tensors, optimizer state keyed by position) into N ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    raw = getattr(model, "module", model)
    raw = getattr(raw, "_orig_mod", raw)
    names = {id(p): n for n, p in raw.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    plain = saved["optimizer"]
    optim_sd = {
        "state": {order[i]: s for i, s in plain["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
            for g in plain["param_groups"]
        ],
    }
    set_state_dict(
        model,
        optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )
