"""Checkpoints that resume exactly and survive a kill at any moment.

Written to a temp file in the same folder, fsynced, then renamed over the old one: a crash leaves
either the previous checkpoint or the new one, never a torn file. Loading uses weights_only=True.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files import DiskFullError, atomic_write, out_of_space

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or from a different run; the message names the fix."""


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy"]["pos"]), 0, 0.0))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> Path:
    path = Path(path)
    state = {"format": CHECKPOINT_FORMAT, **state}
    try:
        atomic_write(path, lambda fh: torch.save(state, fh))
    except DiskFullError as err:
        raise CheckpointError(
            f"no space left writing checkpoint {path} ({out_of_space(err).strerror}); the previous checkpoint "
            "is kept; free space or choose another --checkpoint-dir"
        ) from err
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; start without --resume or point at the run's folder")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a damaged file
        raise CheckpointError(
            f"checkpoint {path} is damaged or not a slipstream checkpoint ({type(err).__name__}); "
            "restore it from a backup or start a fresh run in another folder"
        ) from err
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has an unknown format; it was written by another version")
    return state


def clean_stale_temps(folder: Path) -> int:
    """Remove temp files a killed writer left behind; the real checkpoint is untouched."""
    n = 0
    for tmp in Path(folder).glob(f".{CHECKPOINT_NAME}.*.tmp"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n
