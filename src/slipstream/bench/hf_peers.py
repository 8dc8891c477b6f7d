"""The peers a Hugging Face user would pick for an HF causal LM: `transformers.Trainer`.

- `hf-trainer`: the Trainer with `train_sampling_strategy="group_by_length"` (transformers 5's name
  for `group_by_length=True`) and each batch padded to its longest row — what a careful HF user
  runs on variable-length text.
- `hf-trainer-flat`: the same Trainer with the padding-free `DataCollatorWithFlattening`: the
  batch's documents concatenated into one row with restarting `position_ids` and no attention
  mask, which transformers turns into a block-causal mask for eager/sdpa attention.

How a round is run. The Trainer owns its loop, so we let it: one `trainer.train()` for the whole
benchmark, on a background thread, paused by a callback between rounds (at `on_train_begin` and at
the `on_step_end` that completes a round's real-token budget). A round is: release the pause,
wait until the callback pauses again. So every step of every round is the Trainer's own loop —
its sampler epochs, data collation, loss scaling by `num_items_in_batch`, the per-step nan check,
clipping, optimizer and LR-schedule steps — with one continuous data order and schedule, and its
set-up (accelerator, dataloader, sampler permutation of the first epoch) outside every round.
The alternatives were worse: one `train()` per round (as the Lightning peer does one `fit`) would
restart the data order, the schedule and the sampler each round; driving `training_step` by hand
would time our loop, not the Trainer's. `close()` (the runner calls it when the benchmark ends) stops the run and joins the thread.

Matching the others: batch size (documents per step) = the runner's real tokens per step over the
mean predicted positions per document, so one step carries the matched real tokens on average.
Real tokens are predicted positions, `labels[:, 1:] != -100` (an HF causal LM shifts labels
itself), counted on the host as each batch is collated; padded tokens are padding positions
(attention_mask == 0; none when flattened). Documents are cut to `shapes.max_len` tokens: HF
models number positions by tokens. Precision is the machine probe's verdict (bf16 only where it
pays), optimizer settings and seed are the reference recipe's (constant LR after a linear warm-up:
the bench reference's schedule), the optimizer is the Trainer's default.

group_by_length sorts each megabatch (up to 50 batches) longest first, so a short run sees long
batches: more real tokens per step than the matched average. That is the Trainer's behaviour, kept;
rounds of ~50 steps or more average it out.
"""

from __future__ import annotations

import importlib.util
import queue
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..shapes.loader import IGNORE_INDEX
from .contenders import RoundStats, real_tokens_per_step, sync_device
from .peer_base import PEERS, PeerBase, PeerUnavailable, quiet_loggers

_FOREVER = 10**9
"""The Trainer's max_steps: the benchmark, not the Trainer, decides when training ends."""


def pad_batch(features: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest row: labels = input_ids, -100 at padding, attention_mask 0 there.

    Labels come from the lengths, not from `input_ids == pad_id`: with pad == eos (common in HF),
    DataCollatorForLanguageModeling(mlm=False) would also stop predicting every real EOS."""
    rows = [np.asarray(f["input_ids"], dtype=np.int64) for f in features]
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = labels[i, : len(row)] = torch.from_numpy(row)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def token_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(real, padded) positions of an HF-convention batch: predicted positions after the model's
    shift, and padding positions (a flattened batch has none)."""
    real = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    mask = batch.get("attention_mask")
    return real, 0 if mask is None else int((mask == 0).sum())


@dataclass
class _Round:
    """One round's limits (set by run_round) and what the Trainer thread recorded in it."""

    budget: int | None
    max_steps: int | None
    max_seconds: float | None
    t0: float = 0.0
    real: int = 0
    padded: int = 0
    steps: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)

    def over(self) -> bool:
        return (
            (self.budget is not None and self.real >= self.budget)
            or (self.max_steps is not None and self.steps >= self.max_steps)
            or (self.max_seconds is not None and time.perf_counter() - self.t0 >= self.max_seconds)
        )


class _TrainerPeer(PeerBase):
    flatten = False
    sampling = "group_by_length"

    def __init__(
        self,
        workload: str,
        size: str,
        data,
        reference,
        val_batches: int,
        real_tokens_per_step_target: float | None = None,
    ):
        if importlib.util.find_spec("transformers") is None:
            raise PeerUnavailable("transformers is not installed: pip install 'slipstream[hf]'")
        super().__init__(workload, size, data, reference, val_batches, real_tokens_per_step_target)
        from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

        if not isinstance(self.model, PreTrainedModel):
            raise PeerUnavailable(
                f"workload {workload!r} builds a {type(self.model).__name__}, not a Hugging Face "
                "PreTrainedModel: the Trainer peers train HF models only"
            )
        self.pad_id = data.pad_id
        max_len = self.recipe.shapes.max_len
        # What an HF user's tokenized dataset holds: one row per document, cut to max_len tokens.
        docs = [{"input_ids": np.asarray(s[:max_len], dtype=np.int64)} for s in data.train if len(s) >= 2]
        per_doc = sum(len(d["input_ids"]) - 1 for d in docs) / len(docs)
        target = real_tokens_per_step_target or real_tokens_per_step(self.loader)
        self.batch_size = max(1, round(target / per_doc))

        inner: Callable[[list], dict[str, torch.Tensor]]
        if self.flatten:
            from transformers import DataCollatorWithFlattening

            inner = DataCollatorWithFlattening(return_tensors="pt")
        else:
            inner = lambda features: pad_batch(features, self.pad_id)  # noqa: E731
        # Counted on the host while collating, in step order (the dataloader prefetches, so a
        # FIFO), so recording a step never syncs the device.
        self._counts: deque[tuple[int, int]] = deque()

        def collate(features):
            batch = inner(features)
            self._counts.append(token_counts(batch))
            self.shapes_seen.add(tuple(batch["input_ids"].shape))
            return batch

        self.collator = inner  # uncounted, for checks outside training
        cfg = self.recipe.optimizer
        self._tmp = tempfile.TemporaryDirectory(prefix="slipstream-hf-trainer-")
        args = TrainingArguments(
            output_dir=self._tmp.name,  # nothing is written: no saving, logging or reporting
            per_device_train_batch_size=self.batch_size,
            train_sampling_strategy=self.sampling,
            max_steps=_FOREVER,
            learning_rate=cfg.lr,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_steps,
            lr_scheduler_type="constant_with_warmup",
            max_grad_norm=cfg.grad_clip,
            bf16=self.precision == "bf16",
            use_cpu=self.device.type == "cpu",
            seed=self.recipe.runtime.seed,
            dataloader_num_workers=0,
            torch_compile=False,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
        )
        peer = self

        class Rounds(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if not peer._pause():  # set-up done: wait for the first round
                    control.should_training_stop = True

            def on_step_end(self, args, state, control, **kwargs):
                if not peer._step_done():
                    control.should_training_stop = True

        # The loss of each step, as the model computed it (Trainer's own loss), left on the device.
        self.model.register_forward_hook(lambda module, inputs, out: setattr(self, "_last_loss", out.loss))
        self._go: queue.Queue[_Round] = queue.Queue()
        self._done: queue.Queue[BaseException | None] = queue.Queue()
        self._round: _Round | None = None
        self._failed: BaseException | None = None
        with quiet_loggers("transformers", "accelerate"):
            self.trainer = Trainer(
                model=self.model, args=args, train_dataset=docs, data_collator=collate, callbacks=[Rounds()]
            )
            self._thread = threading.Thread(target=self._train, name=f"slipstream-{self.name}", daemon=True)
            self._thread.start()
            self._wait()  # until set-up is done (or failed)

    # -- the Trainer's thread -------------------------------------------------------------------

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as err:  # handed to the benchmark's thread, which raises it
            self._done.put(err)
        else:
            self._done.put(RuntimeError(f"{self.name}: the Trainer ended its run before the benchmark"))

    def _pause(self) -> bool:
        """Park until the next round; False when the benchmark is over (close) and training must end."""
        self._done.put(None)
        self._round = self._go.get()
        return self._round is not None

    def _step_done(self) -> bool:
        r = self._round
        if r is None:
            return False
        real, padded = self._counts.popleft()
        r.real, r.padded, r.steps = r.real + real, r.padded + padded, r.steps + 1
        r.losses.append(self._last_loss.detach())
        return self._pause() if r.over() else True

    # -- the benchmark's thread -----------------------------------------------------------------

    def _wait(self) -> None:
        err = self._done.get()
        if err is not None:
            self._failed = err  # the thread has ended: no later round may wait on it
            raise err

    def close(self) -> None:
        """End the Trainer's run: its thread (and the model it holds) must not outlive the benchmark."""
        if self._thread.is_alive() and self._failed is None:
            self._go.put(None)
            self._thread.join(timeout=60)

    def run_round(
        self, real_token_budget: int | None, max_steps: int | None = None, max_seconds: float | None = None
    ) -> RoundStats:
        if self._failed is not None:
            raise RuntimeError(f"{self.name}: the Trainer's thread has stopped ({self._failed!r})")
        r = _Round(real_token_budget, max_steps, max_seconds)
        sync_device(self.device)
        r.t0 = time.perf_counter()
        self._go.put(r)
        self._wait()
        sync_device(self.device)
        seconds = time.perf_counter() - r.t0
        losses = torch.stack(r.losses).float().tolist()
        return RoundStats(seconds, r.real, r.padded, r.steps, 0.0, losses)

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "per_device_train_batch_size": self.batch_size,
            "train_sampling_strategy": self.sampling,
            "collator": "DataCollatorWithFlattening" if self.flatten else "pad to longest",
        }


class HFTrainerPeer(_TrainerPeer):
    """transformers.Trainer, length-grouped batches padded to their longest row."""

    name = "hf-trainer"


class HFTrainerFlatPeer(_TrainerPeer):
    """transformers.Trainer with DataCollatorWithFlattening (padding-free). Random sampling: with
    no padding, grouping by length buys nothing."""

    name = "hf-trainer-flat"
    flatten = True
    sampling = "random"


PEERS.update({"hf-trainer": HFTrainerPeer, "hf-trainer-flat": HFTrainerFlatPeer})
