"""Pipeline parallelism for the built-in GPT with `torch.distributed.pipelining`.

Each rank holds a contiguous slice of the model (a *stage*): the embeddings on the first stage, the
final norm, head and loss on the last, the transformer blocks divided as evenly as possible. A global
batch is cut into micro-batches along the batch dimension and a schedule (GPipe, 1F1B, or
interleaved 1F1B with several "virtual" stages per rank) runs their forwards and backwards so that
ranks overlap; each rank then steps its own parameters with an ordinary optimizer.

    stages = split_gpt(build_gpt(...), num_stages=world, stage_index=rank)
    runner = PipelineRunner(stages, rank, world, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(runner.parameters(), lr=3e-4)
    loss = runner.step(batch)            # float on the last stage, None elsewhere
    clip_grad_norm_(runner, 1.0)         # global norm over all stages
    opt.step(); opt.zero_grad()

Gradients equal those of one process on the whole batch: each micro-batch's loss is its *sum* of
per-token losses divided by the number of targets in the whole global batch, and torch's default
1/microbatches scaling is switched off (scale_grads=False). The mean of micro-batch means would
weigh a token of a sparse micro-batch more than one of a dense micro-batch.

The GPT ties lm_head.weight to wte.weight. When the first and last stages sit on different ranks each
holds a copy; after every step their gradients are summed across the two ranks (as Megatron's
embedding group does), so both copies receive the same update and stay identical.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..shapes.ops import count_tokens
from ..workloads.gpt import (
    GPT,
    IGNORE_INDEX,
    document_attention_backend,
    document_block_mask,
    document_causal_mask,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# Batch keys the stages can consume; anything else (attention_mask, ...) is refused, not dropped.
_BATCH_KEYS = {"input_ids", "labels", "position_ids", "document_ids"}


class GPTStage(nn.Module):
    """One pipeline stage of the built-in GPT, sharing the model's own parameter objects.

    forward(x, document_ids=None, position_ids=None): x is input_ids on the first stage and the
    residual stream [b, T, d] elsewhere; returns the residual stream, or ln_f of it on the last stage
    (the loss is taken by `loss`, outside the stage, so torch's schedule can call it per micro-batch).
    document_ids reach every stage (each builds its own attention mask: a mask is cheaper to rebuild
    than to send); position_ids are read by the first stage only.
    """

    def __init__(self, model: GPT, index: int, count: int, blocks: range):
        super().__init__()
        self.index, self.count = index, count
        self.is_first, self.is_last = index == 0, index == count - 1
        self.config = model.config
        self.first_block = blocks.start
        self.tied = model.lm_head.weight is model.wte.weight
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if self.is_last:
            self.ln_f, self.lm_head, self.loss_head = model.ln_f, model.lm_head, model.loss_head

    def forward(
        self, x: Tensor, document_ids: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        if self.is_first:
            B, T = x.shape
            if T > self.config.max_len:
                raise ValueError(f"sequence length {T} exceeds the model's max_len {self.config.max_len}")
            if position_ids is None:
                position_ids = torch.arange(T, device=x.device).expand(B, T)
            x = self.drop(self.wte(x) + self.wpe(position_ids))
        mask = None
        if document_ids is not None:
            if document_attention_backend(self.config.attention, document_ids.device) == "flex":
                mask = document_block_mask(document_ids)
            else:
                mask = document_causal_mask(document_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) if self.is_last else x

    def loss_sum(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Sum of per-token cross-entropies (last stage only): the caller divides by the global count."""
        return self.loss_head(
            hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, labels.reshape(-1), "sum"
        )

    def model_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under their names in the whole GPT (block indices offset, tied head kept)."""
        for name, p in self.named_parameters(remove_duplicate=False):
            if name.startswith("blocks."):
                i, rest = name[len("blocks.") :].split(".", 1)
                name = f"blocks.{int(i) + self.first_block}.{rest}"
            yield name, p


def _block_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Blocks per stage as evenly as possible; the first stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def split_gpt(model: GPT, num_stages: int, stage_index: int, virtual: int = 1) -> list[GPTStage]:
    """The stage modules rank `stage_index` of a `num_stages`-rank pipeline holds.

    With virtual=v the model is cut into num_stages*v stages and this rank holds stages
    stage_index, stage_index + num_stages, ... (torch's loop-style placement for interleaved 1F1B).
    Always a list (one module when virtual=1). The stages share `model`'s parameter objects, so a
    pipeline built from a model made with the same seed starts from the same weights; drop `model`
    afterwards to free the other stages' parameters.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"split_gpt splits slipstream's built-in GPT, not {type(model).__name__}")
    if num_stages < 1 or virtual < 1:
        raise ValueError(f"num_stages={num_stages} and virtual={virtual} must be >= 1")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} must be in [0, num_stages={num_stages})")
    total = num_stages * virtual
    n_layers = len(model.blocks)
    if n_layers < total:
        raise ValueError(
            f"the GPT has {n_layers} blocks but {total} stages were asked for ({num_stages} ranks x "
            f"virtual={virtual}); every stage needs at least one block: lower virtual or use a deeper model"
        )
    ranges = _block_ranges(n_layers, total)
    return [GPTStage(model, s, total, ranges[s]) for s in range(stage_index, total, num_stages)]


@dataclass
class StepTiming:
    """Where one step's time went on this rank (perf_counter seconds)."""

    wall_s: float
    """The whole schedule step, tied-gradient exchange included."""
    busy_s: float
    """Forward, loss and backward compute of this rank's stages; the rest is waiting and sending."""

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


class PipelineRunner:
    """Runs forward + backward of one global batch through the pipeline; the optimizer stays outside.

    Every rank of `group` (default: the world) constructs one with its own stages, and every rank
    calls `step` with the same global batch (the first stage reads input_ids, the last labels, all
    of them the shape and document_ids). The batch's row count must be a multiple of `microbatches`,
    or pad_rows=True appends rows whose labels are all ignored: they add no target, so the loss and
    gradients are unchanged, only compute is spent on them.
    """

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        stage_index: int,
        num_stages: int,
        *,
        schedule: str = "1f1b",
        microbatches: int,
        group: dist.ProcessGroup | None = None,
        pad_rows: bool = False,
    ):
        self.pad_rows = pad_rows
        self.stages: list[GPTStage] = [stages] if isinstance(stages, nn.Module) else list(stages)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if microbatches < 1:
            raise ValueError(f"microbatches={microbatches} must be >= 1")
        virtual = len(self.stages)
        if schedule == "interleaved-1f1b" and virtual < 2:
            raise ValueError(
                "schedule='interleaved-1f1b' needs several stages per rank: split_gpt(..., virtual=2)"
            )
        if schedule != "interleaved-1f1b" and virtual != 1:
            raise ValueError(
                f"schedule={schedule!r} runs one stage per rank; got {virtual} (use interleaved-1f1b)"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineRunner needs torch.distributed initialised (torchrun, init_process_group)"
            )
        self.group = group
        self.group_size = dist.get_world_size(group)
        if self.group_size != num_stages:
            raise ValueError(f"num_stages={num_stages} but the process group has {self.group_size} ranks")
        if dist.get_rank(group) != stage_index:
            raise ValueError(
                f"stage_index={stage_index} must equal this process's rank in the group ({dist.get_rank(group)})"
            )
        if schedule == "1f1b" and microbatches < num_stages:
            raise ValueError(f"1F1B needs microbatches >= stages ({num_stages}); got {microbatches}")
        total = self.stages[0].count
        expected = list(range(stage_index, total, num_stages))
        if [s.index for s in self.stages] != expected or total != num_stages * virtual:
            raise ValueError(
                f"rank {stage_index} must hold stages {expected} of {num_stages * virtual}: "
                f"build them with split_gpt(model, {num_stages}, {stage_index}, virtual={virtual})"
            )
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.stage_index, self.num_stages = stage_index, num_stages
        self.device = next(self.stages[0].parameters()).device
        self.first = next((s for s in self.stages if s.is_first), None)
        self.last = next((s for s in self.stages if s.is_last), None)
        self.last_rank = (total - 1) % num_stages  # group rank of the last stage
        # The tied embedding/head weight lives on two ranks only when first and last stages differ.
        self._tied_peer: int | None = None
        if self.stages[0].tied and self.last_rank != 0:
            if self.first is not None:
                self._tied_peer = self.last_rank
            elif self.last is not None:
                self._tied_peer = 0
        self._pipes: dict[tuple, object] = {}
        self._n_targets: Tensor | None = None
        self._busy = 0.0
        self.timing: StepTiming | None = None

    # -- parameters -------------------------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once: hand them to the optimizer."""
        seen, out = set(), []
        for stage in self.stages:
            for p in stage.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients count towards the global norm: the tied copy on the last rank
        is left out, since the first rank already counts the same (summed) gradient."""
        params = self.parameters()
        if self._tied_peer is not None and self.first is None:
            params = [p for p in params if p is not self.last.lm_head.weight]
        return params

    # -- the step ---------------------------------------------------------------------------------

    def step(self, batch: dict[str, Tensor], *, broadcast_loss: bool = False) -> float | None:
        """Forward + backward of the global batch; gradients accumulate into .grad (zero them after
        the optimizer step, as usual). Returns the token-weighted mean loss of the whole batch on the
        rank holding the last stage, None elsewhere; with broadcast_loss=True (every rank must pass
        it) all ranks get it."""
        return self._run(batch, train=True, broadcast_loss=broadcast_loss)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Tensor]) -> float:
        """Forward only: the token-weighted mean loss of the global batch, on every rank (every rank
        calls it with the same batch). Put the stages in eval mode first, as for one model."""
        return self._run(batch, train=False, broadcast_loss=True)

    def _run(self, batch: dict[str, Tensor], *, train: bool, broadcast_loss: bool) -> float | None:
        unknown = set(batch) - _BATCH_KEYS
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError("a pipeline step trains: the batch needs input_ids and labels")
        if unknown:
            raise ValueError(
                f"the pipelined GPT takes {sorted(_BATCH_KEYS)}; the batch also holds {sorted(unknown)}. "
                "Drop them, or for packed rows give document_ids/position_ids (the GPT convention) "
                "instead of an attention_mask"
            )
        B = batch["input_ids"].shape[0]
        if B % self.microbatches:
            if not self.pad_rows:
                raise ValueError(
                    f"the batch has {B} rows, not a multiple of microbatches={self.microbatches}: "
                    "make the rows per batch a multiple of the micro-batch count, or pass pad_rows=True "
                    "(every micro-batch must have one shape: the stages size their receive buffers once)"
                )
            batch = _pad_rows(batch, self.microbatches - B % self.microbatches)
        input_ids, labels = batch["input_ids"], batch["labels"]
        documents = batch.get("document_ids")
        positions = batch.get("position_ids")
        # Forward-only runs get schedules of their own: a stage sizes its buffers on its first run,
        # and one built without backward could not train later.
        pipe = self._pipe((tuple(input_ids.shape), documents is not None, positions is not None, train))
        args = (input_ids,) if self.first is not None else ()
        kwargs: dict[str, Tensor] = {}
        if documents is not None:
            kwargs["document_ids"] = documents
        if positions is not None and self.first is not None:
            # Every local stage gets the same kwargs; non-first stages ignore position_ids.
            kwargs["position_ids"] = positions
        target = None
        if self.last is not None:
            target = labels
            self._n_targets = count_tokens(labels, IGNORE_INDEX).clamp(min=1)
        losses: list[Tensor] = []
        self._busy = 0.0
        t0 = time.perf_counter()
        if train:
            pipe.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            self._sum_tied_grads()
            self.timing = StepTiming(wall_s=time.perf_counter() - t0, busy_s=self._busy)
        else:
            pipe.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        loss = torch.stack(losses).sum().detach() if self.last is not None else None
        if broadcast_loss:
            buf = loss.float() if loss is not None else torch.zeros((), device=self.device)
            dist.broadcast(buf, src=dist.get_global_rank(self._group(), self.last_rank), group=self.group)
            return float(buf)
        return float(loss) if loss is not None else None

    def _group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def _loss(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """One micro-batch's share of the global mean: its token-loss sum / the whole batch's targets."""
        t = time.perf_counter()
        loss = self.last.loss_sum(hidden, labels) / self._n_targets
        self._busy += time.perf_counter() - t
        return loss

    def _pipe(self, key: tuple) -> object:
        """One torch schedule per batch signature: its stages size their P2P buffers on the first
        step (real forward/backward metadata inference), so a new shape needs new stages."""
        if key not in self._pipes:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            pstages = []
            for stage in self.stages:
                ps = PipelineStage(stage, stage.index, stage.count, self.device, group=self.group)
                self._time_methods(ps)
                pstages.append(ps)
            common = dict(n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
            if self.schedule_name == "gpipe":
                self._pipes[key] = ScheduleGPipe(pstages[0], **common)
            elif self.schedule_name == "1f1b":
                self._pipes[key] = Schedule1F1B(pstages[0], **common)
            else:
                self._pipes[key] = ScheduleInterleaved1F1B(pstages, **common)
        return self._pipes[key]

    def _time_methods(self, ps: object) -> None:
        """Count the compute calls of a torch stage as busy time (the schedule waits for receives
        before calling them, so what they take is compute, not waiting)."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(ps, name, None)
            if inner is None:
                continue

            def timed(*a, _inner=inner, **kw):
                t = time.perf_counter()
                try:
                    return _inner(*a, **kw)
                finally:
                    self._busy += time.perf_counter() - t

            setattr(ps, name, timed)

    def _sum_tied_grads(self) -> None:
        """Sum the tied embedding/head gradient across the first and last ranks (both end up with
        the same sum: two-term float addition commutes, so the copies stay bitwise equal)."""
        if self._tied_peer is None:
            return
        p = self.first.wte.weight if self.first is not None else self.last.lm_head.weight
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        peer = dist.get_global_rank(self._group(), self._tied_peer)
        other = torch.empty_like(p.grad)
        works = [
            dist.isend(p.grad.contiguous(), peer, group=self.group),
            dist.irecv(other, peer, group=self.group),
        ]
        for w in works:
            w.wait()
        p.grad.add_(other)


def _pad_rows(batch: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    """`n` more rows that predict nothing: labels all ignored, one document, positions from 0."""
    ids = batch["input_ids"]
    T = ids.shape[1]
    fill = {
        "input_ids": torch.zeros(n, T, dtype=ids.dtype, device=ids.device),
        "labels": torch.full((n, T), IGNORE_INDEX, dtype=batch["labels"].dtype, device=ids.device),
        "document_ids": torch.zeros(n, T, dtype=torch.long, device=ids.device),
        "position_ids": torch.arange(T, device=ids.device).expand(n, T),
    }
    return {k: torch.cat([v, fill[k].to(v.dtype)]) for k, v in batch.items()}


def clip_grad_norm_(runner: PipelineRunner, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip every rank's gradients by the norm over the *whole* model (all stages), as
    torch.nn.utils.clip_grad_norm_ would in one process. Every rank of the pipeline must call it.
    Returns the total norm."""
    grads = [p.grad for p in runner._norm_parameters() if p.grad is not None]
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max() for g in grads]).max().float() if grads else torch.zeros(())
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=runner.group)
        total = local
    elif norm_type == 2.0:
        local = (
            torch.stack([torch.linalg.vector_norm(g, 2.0).float() ** 2 for g in grads]).sum()
            if grads
            else torch.zeros(())
        )
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=runner.group)
        total = local.sqrt()
    else:
        raise ValueError(f"norm_type={norm_type}: the pipeline clips by the 2-norm or the inf-norm")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    all_grads = [p.grad for p in runner.parameters() if p.grad is not None]
    if all_grads:
        torch._foreach_mul_(all_grads, coef.to(all_grads[0].device))
    return total
