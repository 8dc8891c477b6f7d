"""Peers measured in the same run, on the same model, data and real-token budget.

- `diy`: what a careful user writes by hand — pad each batch to its longest row, bf16 autocast
  where it pays, torch.compile, a plain loop (no slipstream Session).
- `accelerate`: HF Accelerate (mixed_precision="bf16" where it pays) over the same batches.
- `lightning`: PyTorch Lightning (precision="bf16-mixed" where it pays) over the same batches.

"Where it pays" is the machine probe's verdict (slipstream.decisions.decide_precision): a careful
user does not turn on bf16 on a CPU where its matmuls are 75x slower than fp32's.

Peers live behind the optional `peers` extra; one that cannot be built raises PeerUnavailable and
the report says why instead of failing the whole benchmark.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from ..models import loss_of
from .contenders import LoopContender, RoundStats, sync_device
from .peer_base import PEERS, PeerBase, PeerUnavailable, quiet_loggers


class DIYPeer(PeerBase, LoopContender):
    """Hand-written loop: pad to batch max, bf16 autocast, torch.compile, clip, AdamW."""

    name = "diy"

    def __init__(self, *args):
        super().__init__(*args)
        self.optimizer = self._optimizer()
        self.step_fn = torch.compile(self.model)

    def train_step(self, batch) -> torch.Tensor:
        with self.autocast():
            loss = loss_of(self.step_fn(**batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class AcceleratePeer(PeerBase, LoopContender):
    name = "accelerate"

    def __init__(self, *args):
        if importlib.util.find_spec("accelerate") is None:
            raise PeerUnavailable("accelerate is not installed: pip install 'slipstream[peers]'")
        super().__init__(*args)
        from accelerate import Accelerator

        mixed = "bf16" if self.precision == "bf16" else "no"
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=self.device.type == "cpu")
        self.model, self.optimizer = self.accelerator.prepare(self.model, self._optimizer())

    def train_step(self, batch) -> torch.Tensor:
        loss = loss_of(self.model(**batch))
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class LightningPeer(PeerBase):
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
                return loss_of(self.net(**batch["inputs"]))

            def configure_optimizers(self):
                return optimizer  # the same optimizer (and its state) across rounds

        class Budget(L.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if peer._t0 is None:
                    peer._t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                peer._record(outputs["loss"].detach(), batch)
                out_of_time = (
                    peer._max_seconds is not None and time.perf_counter() - peer._t0 >= peer._max_seconds
                )
                if (
                    (peer._budget is not None and peer._real >= peer._budget)
                    or (peer._max_steps is not None and peer._steps >= peer._max_steps)
                    or out_of_time
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

    def run_round(
        self, real_token_budget: int | None, max_steps: int | None = None, max_seconds: float | None = None
    ) -> RoundStats:
        self._t0, self._budget, self._max_steps = None, real_token_budget, max_steps
        self._max_seconds = max_seconds
        self._real = self._padded = self._steps = 0
        self._losses: list[torch.Tensor] = []
        batches = self.batches

        class Stream(torch.utils.data.IterableDataset):
            # Lightning rebuilds mappings when moving them to the device, dropping the Batch's
            # attributes, so the host-side counts travel as plain ints beside the inputs.
            def __iter__(self):
                for b in batches:
                    yield {"inputs": dict(b), "real_tokens": b.real_tokens, "padded_tokens": b.padded_tokens}

        # Lightning announces devices, precision and tips on every Trainer and fit; keep the
        # benchmark's output to its own progress lines (levels restored afterwards).
        with quiet_loggers("lightning.pytorch", "lightning.fabric", "lightning_utilities"):
            trainer = self.L.Trainer(
                accelerator="gpu" if self.device.type == "cuda" else "cpu",
                devices=1,
                precision="bf16-mixed" if self.precision == "bf16" else "32-true",
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
            trainer.fit(self.module, loader)
        sync_device(self.device)
        seconds = time.perf_counter() - (self._t0 or time.perf_counter())
        return RoundStats(
            seconds, self._real, self._padded, self._steps, 0.0, torch.stack(self._losses).float().tolist()
        )


PEERS.update({"diy": DIYPeer, "accelerate": AcceleratePeer, "lightning": LightningPeer})

# The Hugging Face Trainer peers build on PeerBase above and add themselves to PEERS
# (transformers is imported only when one is built).
from . import hf_peers  # noqa: E402, F401
