"""Peers measured in the same run, on the same model, data and real-token budget.

- `diy`: what a careful user writes by hand — pad each batch to its longest row, bf16 autocast,
  torch.compile, a plain loop (no slipstream Session).
- `accelerate`: HF Accelerate with mixed_precision="bf16" over the same pad-to-batch-max batches.
- `lightning`: PyTorch Lightning with precision="bf16-mixed" over the same batches.

Peers live behind the optional `peers` extra; one that cannot be built raises PeerUnavailable and
the report says why instead of failing the whole benchmark.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from ..recipe import Recipe
from ..shapes.loader import ShapedLoader
from ..train import evaluate
from .runner import Contender, LoopContender, RoundStats, _sync


class PeerUnavailable(RuntimeError):
    """This peer cannot run here; the message says why (and how to enable it)."""


class _PeerBase(Contender):
    kind = "peer"
    precision = "bf16"

    def __init__(self, workload: str, size: str, data, reference: Recipe, val_batches: int):
        from ..session import Session
        from ..workloads import get_workload

        # The same shapes budget and optimizer settings as the reference recipe, padded per batch.
        self.recipe = replace(reference, shapes=replace(reference.shapes, mode="pad_batch"))
        self.helper = Session(replace(self.recipe, precision=replace(self.recipe.precision, dtype="bf16")))
        self.device = self.helper.device
        self.model = get_workload(workload).model(size, self.recipe.shapes.max_len).to(self.device)
        self.loader = ShapedLoader(
            data.train,
            self.recipe.shapes,
            seed=self.recipe.runtime.seed,
            device=self.device,
            pad_id=data.pad_id,
            lengths=data.train_lengths,
        )
        self.batches = self.loader.forever()
        self.val_loader = ShapedLoader(
            data.validation,
            replace(reference.shapes, mode="pad_max"),
            device=self.device,
            pad_id=data.pad_id,
            lengths=data.validation_lengths,
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
        return {"distinct_shapes": len(self.shapes_seen)}


class DIYPeer(_PeerBase, LoopContender):
    """Hand-written loop: pad to batch max, bf16 autocast, torch.compile, clip, AdamW."""

    name = "diy"

    def __init__(self, *args):
        super().__init__(*args)
        self.optimizer = self._optimizer()
        self.step_fn = torch.compile(self.model)

    def train_step(self, batch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.step_fn(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class AcceleratePeer(_PeerBase, LoopContender):
    name = "accelerate"

    def __init__(self, *args):
        if importlib.util.find_spec("accelerate") is None:
            raise PeerUnavailable("accelerate is not installed: pip install 'slipstream[peers]'")
        super().__init__(*args)
        from accelerate import Accelerator

        self.accelerator = Accelerator(mixed_precision="bf16", cpu=self.device.type == "cpu")
        self.model, self.optimizer = self.accelerator.prepare(self.model, self._optimizer())

    def train_step(self, batch) -> torch.Tensor:
        loss = self.model(**batch)
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class LightningPeer(_PeerBase):
    """Lightning owns its loop, so each round is one `fit` that stops at the token budget; the round
    is timed from its first batch to its last (Trainer set-up excluded, which favours Lightning)."""

    name = "lightning"

    def __init__(self, *args):
        if importlib.util.find_spec("lightning") is None:
            raise PeerUnavailable("lightning is not installed: pip install 'slipstream[peers]'")
        super().__init__(*args)
        import lightning as L

        peer = self
        optimizer = self._optimizer()

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = peer.model

            def training_step(self, batch, batch_idx):
                return self.net(**batch["inputs"])

            def configure_optimizers(self):
                return optimizer  # the same optimizer (and its state) across rounds

        class Budget(L.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if peer._t0 is None:
                    peer._t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                peer._record(outputs["loss"].detach(), batch)
                if (peer._budget is not None and peer._real >= peer._budget) or (
                    peer._max_steps is not None and peer._steps >= peer._max_steps
                ):
                    trainer.should_stop = True

        self.L = L
        self.module = Module()
        self.callback = Budget()

    def _record(self, loss: torch.Tensor, batch) -> None:
        self._losses.append(loss)
        self._real += int(batch["real_tokens"])
        self._padded += int(batch["padded_tokens"])
        self._steps += 1
        self.shapes_seen.add(tuple(batch["inputs"]["input_ids"].shape))

    def run_round(self, real_token_budget: int | None, max_steps: int | None = None) -> RoundStats:
        self._t0, self._budget, self._max_steps = None, real_token_budget, max_steps
        self._real = self._padded = self._steps = 0
        self._losses: list[torch.Tensor] = []
        batches = self.batches

        class Stream(torch.utils.data.IterableDataset):
            # Lightning rebuilds mappings when moving them to the device, dropping the Batch's
            # attributes, so the host-side counts travel as plain ints beside the inputs.
            def __iter__(self):
                for b in batches:
                    yield {"inputs": dict(b), "real_tokens": b.real_tokens, "padded_tokens": b.padded_tokens}

        trainer = self.L.Trainer(
            accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=1,
            precision="bf16-mixed",
            max_steps=-1,
            max_epochs=1,
            gradient_clip_val=self.recipe.optimizer.grad_clip,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[self.callback],
        )
        loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
        # Lightning announces devices and tips on every fit; keep the benchmark's output readable.
        log = logging.getLogger("lightning.pytorch")
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            trainer.fit(self.module, loader)
        finally:
            log.setLevel(level)
        _sync(self.device)
        seconds = time.perf_counter() - (self._t0 or time.perf_counter())
        return RoundStats(
            seconds, self._real, self._padded, self._steps, 0.0, torch.stack(self._losses).float().tolist()
        )


PEERS: dict[str, type[_PeerBase]] = {"diy": DIYPeer, "accelerate": AcceleratePeer, "lightning": LightningPeer}
