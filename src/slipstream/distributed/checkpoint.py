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
from ..files import fsync_dir
from ..models import unwrap
from .env import DistEnv
from .wrap import local_module

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
    """Every rank's (sharded or replicated) model and optimizer state, as torch lays them out."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return _write(folder, {"model": model_sd, "optim": optim_sd}, meta, env)


NAMED_LAYOUT = "named"
"""meta["layout"] of a checkpoint keyed by whole-model parameter names (pipeline stages)."""


def save_named_dcp(
    folder: Path,
    named: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    env: DistEnv,
) -> Path:
    """Each rank writes the parameters it holds, and their optimizer state, under their names in
    the whole model (pipeline stages hold disjoint slices). Keyed by name and not by stage, the
    checkpoint resumes under another stage layout, or in one process holding the whole model."""
    state = {
        "model": {n: p.detach() for n, p in named.items()},
        "optim": {"state": {n: dict(optimizer.state[p]) for n, p in named.items() if optimizer.state.get(p)}},
    }
    return _write(folder, state, {**meta, "layout": NAMED_LAYOUT}, env)


def _write(folder: Path, state: dict[str, Any], meta: dict[str, Any], env: DistEnv) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    final, tmp, old = folder / DCP_NAME, folder / f".{DCP_NAME}.tmp", folder / f".{DCP_NAME}.old"
    if env.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(env)
    dcp.save(state, checkpoint_id=str(tmp))
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
        fsync_dir(folder)
    _barrier(env)
    return final


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


def _state_by_name(plain: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """A one-process optimizer state (keyed by position) keyed by parameter name instead."""
    return {order[i]: s for i, s in plain["state"].items()}


def _on_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One parameter's optimizer state beside it; 0-d tensors (Adam's step) stay on the host."""
    return {k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def load_full(saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A 1-process checkpoint (full tensors, optimizer state keyed by position) into N ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    raw = unwrap(local_module(model))
    names = {id(p): n for n, p in raw.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    plain = saved["optimizer"]
    optim_sd = {
        "state": _state_by_name(plain, order),
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


def _source(name: str, stored: set[str], aliases: dict[str, str]) -> str:
    """The stored name `name` reads from: itself, or the parameter it is tied to."""
    if name in stored:
        return name
    alias = aliases.get(name)
    if alias is not None and alias in stored:
        return alias
    raise CheckpointError(
        f"the checkpoint has no parameter {name!r}: it was written for another model; "
        "resume with the same workload and size, or use a new --checkpoint-dir"
    )


def load_named_dcp(
    path: Path,
    named: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    aliases: dict[str, str] | None = None,
) -> None:
    """Read a `save_named_dcp` checkpoint into the parameters `named` (whatever slice of the model
    this process holds) and their optimizer state. `aliases`: tied names (lm_head.weight ->
    wte.weight) for a parameter stored under the name of its twin."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    params = {k[len("model.") :] for k in stored if k.startswith("model.")}
    source = {n: _source(n, params, aliases or {}) for n in named}
    state: dict[str, Any] = {
        "model": {source[n]: p.detach() for n, p in named.items()},
        "optim": {"state": {}},
    }
    wanted = set(source.values())
    for key, md in stored.items():
        if not key.startswith("optim.state."):
            continue
        name, field = key[len("optim.state.") :].rsplit(".", 1)
        if name in wanted:
            value = (
                torch.empty(md.size, dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else None
            )
            state["optim"]["state"].setdefault(name, {})[field] = value
    dcp.load(state, checkpoint_id=str(path))
    for n, p in named.items():
        saved = state["optim"]["state"].get(source[n])
        if saved:
            optimizer.state[p] = _on_device(saved, p.device)


def load_named_full(
    saved: dict[str, Any],
    named: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    order: list[str],
    aliases: dict[str, str] | None = None,
) -> None:
    """A 1-process `checkpoint.pt` (whole model; optimizer state by position, `order` naming the
    positions) into the parameters `named` that this rank holds."""
    model = saved["model"]
    by_name = _state_by_name(saved["optimizer"], order)
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(model[_source(n, set(model), aliases or {})])
            # a tied head has no optimizer position of its own: its twin's state is its state
            state = by_name.get(n, by_name.get((aliases or {}).get(n, n)))
            if state:
                optimizer.state[p] = _on_device(state, p.device)
