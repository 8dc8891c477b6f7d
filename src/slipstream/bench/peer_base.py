"""What the peers (other tools run side by side with slipstream) share: the base peer, the
unavailable signal, the registry by name, and quieting their loggers."""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import replace
from typing import Any

import torch

from ..models import detect_convention
from ..recipe import Recipe
from ..shapes.loader import ShapedLoader
from ..train import evaluate
from .contenders import Contender, matched_loader


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Silence these libraries' loggers and their deprecation/user warnings (restored after)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for name in names:
                warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")
            warnings.filterwarnings("ignore", message=r".*(treespec|LeafSpec|litmodels).*")
            yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


class PeerUnavailable(RuntimeError):
    """This peer cannot run here; the message says why (and how to enable it)."""


class PeerBase(Contender):
    kind = "peer"

    def __init__(
        self,
        workload: str,
        size: str,
        data,
        reference: Recipe,
        val_batches: int,
        real_tokens_per_step: float | None = None,
    ):
        from ..decisions import decide_precision
        from ..runtime import resolve_device
        from ..session import Session
        from ..workloads import get_workload

        # A careful user picks bf16 only where it pays: the peers take the probe's verdict too.
        device = resolve_device(reference.runtime.device)
        self.precision_decision = decide_precision(device)
        self.precision = "bf16" if self.precision_decision.choice == "bf16" else "fp32"
        # The same shapes budget and optimizer settings as the reference recipe, padded per batch.
        self.recipe = replace(reference, shapes=replace(reference.shapes, mode="pad_batch"))
        self.helper = Session(
            replace(self.recipe, precision=replace(self.recipe.precision, dtype=self.precision))
        )
        self.device = self.helper.device
        self.model = get_workload(workload).model(size, self.recipe.shapes.max_len).to(self.device)
        self.convention, _ = detect_convention(self.model)  # HF models: labels unshifted, -100 at padding

        def loader(tokens_per_batch: int | None) -> ShapedLoader:
            shapes = self.recipe.shapes
            if tokens_per_batch is not None:
                shapes = replace(shapes, tokens_per_batch=tokens_per_batch)
            return ShapedLoader(
                data.train,
                shapes,
                seed=self.recipe.runtime.seed,
                device=self.device,
                pad_id=data.pad_id,
                lengths=data.train_lengths,
                convention=self.convention,
            )

        shapes = self.recipe.shapes
        self.loader = matched_loader(loader, shapes.tokens_per_batch, real_tokens_per_step, shapes.max_len)
        self.batches = self.loader.forever()
        self.val_loader = ShapedLoader(
            data.validation,
            replace(reference.shapes, mode="pad_max"),
            device=self.device,
            pad_id=data.pad_id,
            lengths=data.validation_lengths,
            convention=self.convention,
        )
        self.val_batches = val_batches
        self.shapes_seen: set[tuple[int, int]] = set()

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg = self.recipe.optimizer
        return torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )

    def validation_loss(self) -> float:
        return evaluate(self.model, self.val_loader, self.helper, self.val_batches)

    def info(self) -> dict[str, Any]:
        return {
            "distinct_shapes": len(self.shapes_seen),
            "precision_reason": self.precision_decision.reason,
        }

    def autocast(self):
        """bf16 autocast where the probe says it pays; nothing otherwise (fp32)."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


PEERS: dict[str, type] = {}
"""Peers by name; peers.py and hf_peers.py register theirs."""
