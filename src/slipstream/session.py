"""Session: prepares the user's model, optimizer and data by the recipe, without owning the loop.

    session = slipstream.Session(recipe)
    model = session.prepare_model(model)
    optimizer = session.prepare_optimizer(torch.optim.AdamW(model.parameters()))
    loader = session.prepare_loader(sequences)
    for batch in loader:
        with session.autocast():
            loss = model(**batch)
        session.backward(loss)
        session.step(optimizer)
    session.metrics()

Optimizations are applied to the model by ordered plain functions (`apply_kernels`, `apply_fp8`,
`apply_activation_checkpointing`, `apply_compile`, `apply_cudagraphs`), each reading only its own
part of the recipe.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from . import precision as _precision
from .compile import apply_activation_checkpointing, apply_compile, apply_cudagraphs, compile_stats
from .dataflow import PrefetchLoader
from .decisions import Decision
from .distributed.env import DistEnv, agree, init_process_group, local_device
from .metrics import MetricsSummary, MetricsTracker
from .models.convention import SHIFTED, BatchConvention, detect_convention, is_hf_model, loss_of, unwrap
from .optimizers import Params, build_optimizer, resolve_optimizer_impl
from .precision import LossScaler, resolve_precision, resolve_precision_decision
from .recipe import KernelsConfig, Recipe, RecipeError, check_field
from .runtime import resolve_device, seed_everything
from .samples import SampleLoader
from .shapes.loader import ShapedLoader

if TYPE_CHECKING:
    from .distributed.shards import StepShards

__all__ = [
    "Session",
    "apply_compile",
    "apply_kernels",
    "build_optimizer",
    "resolve_device",
    "resolve_precision",
]


def apply_kernels(
    model: nn.Module, cfg: KernelsConfig, device: torch.device, chooser: Any = None
) -> dict[str, object]:
    """Swap fused kernels into this model instance; returns what was swapped. Under ``auto``,
    ``chooser`` (a kernels.KernelChooser) times each op's candidates and only winners are swapped."""
    hf = is_hf_model(model)
    if hf:
        from .models.hf import prepare_forward

        prepare_forward(model)  # no KV cache while training, whatever the kernels
    if cfg.ops == "off":
        return {}
    if hf:
        from .models.hf import apply_hf_kernels as swap
    else:
        from .kernels import apply_kernels as swap  # lazy: Triton is optional
    report = swap(model, cfg.ops, device, chooser=chooser)
    out: dict[str, object] = {
        "kernels_swapped": dict(report.swapped),
        "kernels_backend": report.backend,
        "kernels_backends": dict(report.backends),
    }
    if report.skipped:
        out["kernels_skipped"] = dict(report.skipped)
    if report.timings:
        out["kernels_timings"] = dict(report.timings)
    return out


def _kernels_decisions(swapped: dict[str, object]) -> list[Decision]:
    """One decision per timed op (`kernels.<op>`: the candidate installed, or keep) and the summary
    `kernels.ops` (op=backend for every swap, which a resumed run installs again untimed)."""
    timings: dict[str, dict] = swapped.get("kernels_timings", {})  # type: ignore[assignment]
    backends: dict[str, str] = swapped.get("kernels_backends", {})  # type: ignore[assignment]
    out = [Decision(f"kernels.{op}", t["choice"], t["reason"]) for op, t in sorted(timings.items())]
    summary = ",".join(f"{op}={b}" for op, b in sorted(backends.items())) or "none"
    why = "each op timed fwd+bwd against the model's own module; swapped only where a candidate won"
    return [*out, Decision("kernels.ops", summary, why)]


def _resumed_kernels(decisions: dict[str, dict[str, str]]) -> dict[str, str] | None:
    kept = decisions.get("kernels.ops")
    if kept is None:
        return None
    choice = kept["choice"]
    return {} if choice == "none" else dict(item.split("=", 1) for item in choice.split(",") if "=" in item)


def _vocab_size(model: nn.Module | None) -> int | None:
    """Rows of the prepared model's input embedding (Hugging Face's get_input_embeddings, the
    built-in GPT's wte), so the loader refuses ids it cannot look up; None when unknown."""
    if model is None:
        return None
    model = unwrap(model)
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else getattr(model, "wte", model)
    except NotImplementedError:  # a transformers model class without an input embedding
        return None
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None


class Session:
    def __init__(
        self,
        recipe: Recipe | str | None = None,
        *,
        decisions: dict[str, dict[str, str]] | None = None,
        convention: str | None = None,
    ):
        """`recipe`: a Recipe, a preset name ("bf16"), a recipe file ("my.toml") or a spec
        ("baseline+shapes.mode=bucket"); None is the default Recipe(). `decisions`: `auto`
        choices taken earlier (a resumed run's `state_dict()["decisions"]`), reused instead of
        measured again, so a resumed run keeps its dtype and data order. `convention`: the
        model's batch convention when it cannot be detected ("shifted" or "unshifted"; see
        slipstream.models); by default it is learned from the model in prepare_model."""
        if isinstance(recipe, (str, os.PathLike)):
            from .presets import resolve_recipe

            recipe = resolve_recipe(os.fspath(recipe))
        elif recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"Session(recipe) takes a Recipe, a preset name ('bf16'), a recipe file path or a "
                f"'preset+section.field=value' spec, not {type(recipe).__name__} {recipe!r}"
            )
        self.recipe = recipe if recipe is not None else Recipe()
        self.dist = DistEnv.from_environ()
        """This process's place among the ranks (torchrun's environment; one rank when absent)."""
        self.device = local_device(resolve_device(self.recipe.runtime.device), self.dist)
        init_process_group(self.dist, self.device, self.recipe.distributed.timeout_s)
        earlier = dict(decisions or {})
        if self.recipe.precision.dtype == "auto" and "precision.dtype" in earlier:
            kept = earlier["precision.dtype"]
            decision = Decision(
                "precision.dtype", kept["choice"], f"kept from the resumed run: {kept['reason']}"
            )
        else:
            decision = agree(resolve_precision_decision(self.recipe.precision, self.device), self.dist)
        self.precision = decision.choice
        self._restore_process_state = seed_everything(
            self.recipe.runtime.seed, self.recipe.runtime.deterministic
        )
        self._apply_tf32(earlier)
        self.tracker = MetricsTracker(self.device, self.precision)
        self.decisions: dict[str, dict[str, str]] = {
            k: v for k, v in earlier.items() if k != "precision.dtype"
        }
        """Every `auto` this session resolved: field -> {choice, reason} (also in metrics)."""
        if self.decisions:
            self.tracker.extra["decisions"] = self.decisions
        if self.recipe.precision.dtype == "auto":
            self.tracker.extra["precision_auto_choice"] = self.precision
            self.record(decision)
        if self.recipe.precision.tf32 != "off":
            self.record(self._tf32)
        self.scaler: LossScaler | None = None
        if self.precision == "fp16":
            self.scaler = LossScaler(self.device, self.recipe.precision)
            self.tracker.extra["loss_scale"] = self.scaler.loss_scale
        self.clip_grad_norm: Callable[[list[torch.Tensor], float], torch.Tensor] = (
            torch.nn.utils.clip_grad_norm_
        )
        """How `step` clips: the norm over these parameters; a pipeline stage replaces it with the
        norm over all stages (slipstream.distributed.pipeline.clip_grad_norm_)."""
        self.last_step_skipped = False
        """True when the last `step` was skipped because of inf/nan gradients (fp16 only)."""
        self.schedulers: dict[int, torch.optim.lr_scheduler.LRScheduler] = {}
        self.model: nn.Module | None = None
        self.local_model: nn.Module | None = None
        """The prepared model before DDP wrapped it: what each rank times and checks alone."""
        self.declared_convention = convention
        self.convention: BatchConvention = SHIFTED
        """The prepared model's batch convention: what prepare_loader's batches look like."""
        self._packing_problem: str | None | bool = False  # False: not checked yet
        self.step_count = 0

    def _apply_tf32(self, earlier: dict[str, dict[str, str]]) -> None:
        """precision.tf32: decided once (a resumed run keeps it), switched on for this session and
        put back by close()."""
        from .decisions import decide_tf32

        requested = self.recipe.precision.tf32
        kept = earlier.get("precision.tf32")
        decision = (
            Decision("precision.tf32", kept["choice"], f"kept from the resumed run: {kept['reason']}")
            if kept and requested == "auto"
            else decide_tf32(requested, self.device, self.precision)
        )
        self._tf32 = agree(decision, self.dist)
        if self._tf32.choice != "on":
            return
        before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        restore_seeded = self._restore_process_state

        def restore() -> None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
            restore_seeded()

        self._restore_process_state = restore

    def close(self) -> None:
        """Put back the process-wide switches this session changed (deterministic algorithms,
        cuDNN autotuning, the cuBLAS workspace); the built-in loop calls it when it ends. Also
        `with Session(...) as session:`."""
        self._restore_process_state()
        self._restore_process_state = lambda: None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- preparation ----------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move to the device and apply, in order: kernels, fp8 layers, activation checkpointing,
        torch.compile, CUDA graphs per shape. The returned model's `_orig_mod` (when it has one)
        holds the same parameters under the same state_dict keys."""
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"prepare_model takes the model (a torch.nn.Module), not {type(model).__name__}; "
                "call your factory first: session.prepare_model(build())"
            )
        cfg = self.recipe.compile
        self.convention, why = detect_convention(model, self.declared_convention)
        self.tracker.extra["batch_convention"] = self.convention.name
        self.record(Decision("model.convention", self.convention.name, why))
        self._packing_problem = False
        model = model.to(self.device)
        swapped = apply_kernels(model, self.recipe.kernels, self.device, self._kernel_chooser())
        self.tracker.extra.update(swapped)
        if self.recipe.kernels.ops == "auto":
            for decision in _kernels_decisions(swapped):
                self.record(decision)
        if self.precision == "fp8":
            self.tracker.extra.update(_precision.apply_fp8(model))
        wrapped = apply_activation_checkpointing(model, cfg.activation_checkpointing)
        if wrapped:
            self.tracker.extra["checkpointed_blocks"] = wrapped
        if cfg.mode == "auto":
            if "compile.mode" not in self.decisions:  # a resumed run keeps its choice
                self.record(agree(self._decide_compile(model), self.dist))
            cfg = replace(cfg, mode=self.decisions["compile.mode"]["choice"])
            self.recipe = replace(self.recipe, compile=cfg)
        model = apply_compile(model, cfg)
        model = apply_cudagraphs(model, cfg, self.device)
        self.tracker.extra["compiled"] = cfg.mode != "off"
        self.local_model = model
        if self.dist.active and self.recipe.distributed.strategy != "pipeline":
            from .distributed.wrap import apply_data_parallel

            model = apply_data_parallel(
                model, self.recipe.distributed, self.dist, self.device, self.precision
            )
            self.tracker.extra.update(
                world_size=self.dist.world_size, distributed_strategy=self.recipe.distributed.strategy
            )
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module, total_steps: int | None = None) -> torch.optim.Optimizer:
        """The recipe's optimizer over `model`, already prepared (schedule over `total_steps`)."""
        cfg = self.recipe.optimizer
        if cfg.impl == "auto":
            decision = agree(self._decide_optimizer_impl(model), self.dist)
            self.record(decision)
            cfg = replace(cfg, impl=decision.choice)  # type: ignore[arg-type]
        self.tracker.extra["optimizer_impl"] = resolve_optimizer_impl(cfg, self.device)
        optimizer = build_optimizer(model, cfg, self.device)
        return self.prepare_optimizer(optimizer, total_steps)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, total_steps: int | None = None
    ) -> torch.optim.Optimizer:
        """Attach the recipe's learning-rate schedule; decaying schedules need `total_steps`."""
        cfg = self.recipe.optimizer
        if cfg.warmup_steps > 0 or cfg.schedule != "constant":
            from .schedules import build_scheduler

            self.schedulers[id(optimizer)] = build_scheduler(optimizer, cfg, total_steps)
        return optimizer

    def prepare_loader(
        self,
        sequences: Sequence,
        tokens_per_batch: int | None = None,
        max_len: int | None = None,
        *,
        pad_id: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        lengths: np.ndarray | None = None,
    ) -> ShapedLoader | PrefetchLoader:
        """Batches of `sequences` (1-D token id lists) shaped by recipe.shapes; arguments override it.

        Under torchrun each rank gets its own shard (every world_size-th batch of one shared plan,
        the same shape on every rank at each step); `rank`/`world_size` override the environment.
        With dataflow.prefetch the batches are collated on a background thread and copied to the
        device on a side stream (a PrefetchLoader that otherwise behaves as the ShapedLoader)."""
        rank = self.dist.rank if rank is None else rank
        world_size = self.dist.world_size if world_size is None else world_size
        loader = self._shaped_loader(
            sequences,
            tokens_per_batch,
            max_len,
            pad_id=pad_id,
            lengths=lengths,
            rank=rank,
            world_size=world_size,
        )
        return self._maybe_prefetch(loader)

    def prepare_step_loader(
        self,
        sequences: Sequence,
        *,
        pad_id: int = 0,
        lengths: np.ndarray | None = None,
        data_parallel: bool = True,
    ) -> StepShards | PrefetchLoader:
        """This rank's micro-batches of each optimizer step (slipstream.distributed.shards): the
        built-in loop's loader, in one process or many. Each batch carries `weight` (its share of
        the step's targets) and `step_end`. `data_parallel=False`: every rank gets the whole
        global batch (pipeline stages all see the same batch)."""
        from .distributed.shards import StepShards

        rank, world = (self.dist.rank, self.dist.world_size) if data_parallel else (0, 1)
        per_step = self.recipe.distributed.batches_per_step or world
        loader = self._shaped_loader(sequences, None, None, pad_id=pad_id, lengths=lengths, group=per_step)
        shards = StepShards(loader, batches_per_step=per_step, rank=rank, world_size=world)
        self.tracker.extra["batches_per_step"] = per_step
        return self._maybe_prefetch(shards)  # type: ignore[arg-type]

    def _shaped_loader(
        self,
        sequences: Sequence,
        tokens_per_batch: int | None,
        max_len: int | None,
        *,
        pad_id: int,
        lengths: np.ndarray | None,
        rank: int = 0,
        world_size: int = 1,
        group: int | None = None,
    ) -> ShapedLoader:
        from dataclasses import replace

        cfg = self.recipe.shapes
        # Arguments that override recipe fields are checked as the fields are (type and range).
        if tokens_per_batch is not None:
            cfg = replace(cfg, tokens_per_batch=check_field("shapes.tokens_per_batch", tokens_per_batch))
        if max_len is not None:
            cfg = replace(cfg, max_len=check_field("shapes.max_len", max_len))
        if cfg.mode == "pack":
            self._check_packing(sequences, cfg.max_len)
        elif cfg.mode == "auto":
            if "shapes.mode" not in self.decisions:  # decided once per session, then reused
                decision = agree(
                    self._decide_shape_mode(sequences, cfg, pad_id=pad_id, lengths=lengths), self.dist
                )
                self.tracker.extra["shape_mode_auto_choice"] = decision.choice
                self.record(decision)
            cfg = replace(cfg, mode=self.decisions["shapes.mode"]["choice"])
        if tokens_per_batch is None and self._searches_batch(cfg):
            if "shapes.tokens_per_batch" not in self.decisions:  # once per session; a resumed run keeps it
                decision = agree(
                    self._decide_tokens_per_batch(sequences, cfg, pad_id=pad_id, lengths=lengths), self.dist
                )
                self.record(decision)
            cfg = replace(cfg, tokens_per_batch=int(self.decisions["shapes.tokens_per_batch"]["choice"]))
        flow = self.recipe.dataflow
        loader = ShapedLoader(
            sequences,
            cfg,
            seed=self.recipe.runtime.seed,
            # Prefetching collates on the host and moves batches itself (pinned, side stream).
            device="cpu" if flow.prefetch else self.device,
            pad_id=pad_id,
            rank=rank,
            world_size=world_size,
            lengths=lengths,
            on_batch=None if flow.prefetch else self.tracker.on_batch,
            convention=self.convention,
            group=group,
            vocab_size=_vocab_size(self.local_model),
        )
        self.tracker.extra["shape_policy"] = loader.policy.name
        self.tracker.extra["overflowed_sequences"] = loader.overflow.overflowed
        self.tracker.extra["truncated_tokens"] = loader.overflow.dropped_tokens
        self.tracker.extra["overflow_policy"] = cfg.overflow
        self.tracker.extra.update(loader.policy.describe())
        if flow.workers > 0:
            # Collating token ids is cheap; worker pools are for per-sample decode (prepare_samples).
            self.tracker.extra["dataflow_workers_unused"] = flow.workers
        return loader

    def prepare_samples(
        self,
        dataset: object,
        batch_size: int,
        *,
        collate: object = None,
        seed: int | None = None,
        shuffle: bool = True,
    ) -> SampleLoader | PrefetchLoader:
        """Batches of a map-style dataset of CPU-heavy samples (images to decode and augment), with
        recipe.dataflow's worker pool and prefetching."""
        flow = self.recipe.dataflow
        loader = SampleLoader(
            dataset,
            batch_size,
            collate=collate,  # type: ignore[arg-type]
            workers=flow.workers,
            worker_kind=flow.worker_kind,
            seed=self.recipe.runtime.seed if seed is None else seed,
            shuffle=shuffle,
            device="cpu" if flow.prefetch else self.device,
            on_batch=None if flow.prefetch else self.tracker.on_batch,
        )
        self.tracker.extra["dataflow_workers"] = flow.workers
        self.tracker.extra["dataflow_worker_kind"] = flow.worker_kind
        return self._maybe_prefetch(loader)

    def _maybe_prefetch(self, loader: Any) -> Any:
        flow = self.recipe.dataflow
        self.tracker.extra["prefetch_depth"] = flow.prefetch_depth if flow.prefetch else 0
        if not flow.prefetch:
            return loader
        return PrefetchLoader(loader, flow.prefetch_depth, device=self.device, on_batch=self.tracker.on_batch)

    def _trial_loader(self, sequences: Sequence, cfg, pad_id: int, lengths) -> ShapedLoader:
        """A loader under `cfg` on the device, for a trial of an `auto` choice (not the run's own)."""
        return ShapedLoader(
            sequences,
            cfg,
            seed=self.recipe.runtime.seed,
            device=self.device,
            pad_id=pad_id,
            lengths=lengths,
            convention=self.convention,
        )

    def _searches_batch(self, cfg) -> bool:
        """shapes.batch_search=auto on CUDA with tokens_per_batch at its default (not pinned), once
        the model is known."""
        from .batch_size import searches_batch

        return searches_batch(cfg, self.device) and self.local_model is not None

    def _decide_tokens_per_batch(self, sequences: Sequence, cfg, *, pad_id: int, lengths) -> Decision:
        """Tokens per batch by the knee of measured tokens/s on this model (slipstream.batch_size)."""
        from .batch_size import find_knee, step_timer

        model = unwrap(self.local_model)  # eager: a trial must not compile

        def batches_at(tokens: int):
            return self._trial_loader(sequences, replace(cfg, tokens_per_batch=tokens), pad_id, lengths)

        measure = step_timer(model, batches_at, self.autocast, self.device, loss_of)
        memory = torch.cuda.get_device_properties(self.device).total_memory
        with torch.random.fork_rng(devices=[self.device]):
            choice = find_knee(measure, cfg.tokens_per_batch, memory_bytes=memory)
        return Decision("shapes.tokens_per_batch", str(choice.tokens), choice.reason)

    def _decide_compile(self, model: nn.Module) -> Decision:
        """compile.mode=auto: on CUDA a step timed eager and compiled (slipstream.compile_choice);
        on a CPU off, unmeasured: compiling costs tens of seconds per shape there, which only a
        run's length can repay (`slipstream optimize`'s compile stage weighs it)."""
        if self.device.type != "cuda":
            return Decision(
                "compile.mode", "off", f"{self.device.type}: not measured (optimize's compile stage times it)"
            )
        from .compile_choice import measure_compile
        from .kernels.chooser import model_widths

        shapes = self.recipe.shapes
        row = min(shapes.max_len, 1024)
        rows = max(1, self._step_tokens() // row)
        vocab = model_widths(model, rows).vocab
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (rows, row), generator=gen).to(self.device)
        batch = {"input_ids": ids, "labels": ids}

        def step_of(m: nn.Module):
            def step() -> None:
                with self.autocast():
                    loss = loss_of(m(**batch))
                loss.backward()

            return step

        with torch.random.fork_rng(devices=[self.device]):
            return measure_compile(model, step_of, self.device)

    def _step_tokens(self) -> int:
        """Tokens per batch the run will step at, as far as known when the model is prepared: a
        searched size already decided (bench adopts its reference's before building the model), else
        the recipe's."""
        searched = self.decisions.get("shapes.tokens_per_batch")
        return int(searched["choice"]) if searched else self.recipe.shapes.tokens_per_batch

    def _kernel_chooser(self):
        """kernels.ops=auto: time at the run's tokens per batch in the compute dtype, knowing
        whether the whole model will be compiled; a resumed run installs its earlier choices."""
        if self.recipe.kernels.ops != "auto":
            return None
        from .kernels import KernelChooser

        dtype = _precision.AUTOCAST_DTYPES.get(
            self.precision, torch.bfloat16 if self.precision == "fp8" else torch.float32
        )
        return KernelChooser(
            rows=self._step_tokens(),
            dtype=dtype,
            compiled_model=self.recipe.compile.mode not in ("off", "auto"),
            fixed=_resumed_kernels(self.decisions),
            agree=lambda verdicts: agree(verdicts, self.dist),
        )

    def _decide_optimizer_impl(self, model: nn.Module) -> Decision:
        """optimizer.impl=auto: foreach or fused, timed on copies of this model's parameters."""
        from .trial import time_optimizer_impls

        if "optimizer.impl" in self.decisions:  # a resumed run keeps its choice
            kept = self.decisions["optimizer.impl"]
            return Decision("optimizer.impl", kept["choice"], kept["reason"])
        params = [p for p in model.parameters() if p.requires_grad]
        cfg = self.recipe.optimizer
        if self.dist.active and self.recipe.distributed.strategy == "fsdp":
            return Decision("optimizer.impl", "foreach", "fsdp: sharded parameters are not timed on copies")

        def make(copies: list[torch.Tensor], impl: str) -> torch.optim.Optimizer:
            return build_optimizer(Params(copies), replace(cfg, impl=impl), self.device)  # type: ignore[arg-type]

        timings = time_optimizer_impls(params, make) if params else None
        if not timings:
            choice = "fused" if self.device.type == "cuda" else "foreach"
            return Decision("optimizer.impl", choice, "not timed (no parameters, or too large to copy)")
        choice = min(timings, key=timings.__getitem__)
        figures = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(timings.items()))
        return Decision(
            "optimizer.impl", choice, f"one optimizer step timed on copies of the parameters: {figures}"
        )

    def packing_problem(self, sequences: Sequence = (), max_len: int | None = None) -> str | None:
        """Why packed rows would train this model on another function (None: checked, they don't).

        Measured once per prepared model: each of a few documents of `sequences` gives the same
        loss packed with the others as alone (slipstream.models.verify), in a row no wider than
        `max_len` (default shapes.max_len: the rows the loader builds)."""
        if self.local_model is None:
            return None
        if self._packing_problem is False:
            from .models.verify import packing_problem

            self._packing_problem = packing_problem(
                self.local_model,
                self.convention,
                self.device,
                sequences,
                max_len=self.recipe.shapes.max_len if max_len is None else max_len,
            )
        return self._packing_problem  # type: ignore[return-value]

    def _check_packing(self, sequences: Sequence, max_len: int) -> None:
        problem = self.packing_problem(sequences, max_len)
        if problem:
            raise RecipeError(f"shapes.mode=pack refused: {problem}; use shapes.mode=bucket (or auto)")

    def _decide_shape_mode(self, sequences: Sequence, cfg, *, pad_id: int, lengths) -> Decision:
        """shapes.mode=auto: pack or bucket, by timing both on this model (see slipstream.trial)."""
        from dataclasses import replace

        from .trial import TrialError, time_loaders

        if self.local_model is None:
            return Decision("shapes.mode", "pack", "model not prepared before the loader: not measured")
        problem = self.packing_problem(sequences, cfg.max_len)
        if problem:
            return Decision("shapes.mode", "bucket", f"packing refused: {problem}")
        if self.dist.active and self.recipe.distributed.strategy == "fsdp":
            # A trial on sharded parameters would run collectives a time limit could leave unmatched.
            return Decision("shapes.mode", "pack", "fsdp: not measured (packing is exact for this model)")
        model = unwrap(self.local_model)  # eager: a trial must not compile
        loaders = {
            mode: self._trial_loader(sequences, replace(cfg, mode=mode), pad_id, lengths)
            for mode in ("bucket", "pack")
        }
        try:
            speeds = time_loaders(model, loaders, self.autocast, self.device)
        except TrialError as err:
            return Decision("shapes.mode", "pack", f"not measured ({err})")
        choice = max(speeds, key=lambda m: speeds[m].real_tokens_per_s)
        figures = ", ".join(
            f"{m} {t.real_tokens_per_s:,.0f} real tok/s ({t.shapes} shapes)" for m, t in speeds.items()
        )
        spent = sum(t.seconds for t in speeds.values())
        return Decision("shapes.mode", choice, f"measured on this model in {spent:.1f} s: {figures}")

    def record(self, decision: Decision) -> None:
        """Keep an `auto` decision and its reason (metrics()'s extra["decisions"])."""
        self.decisions[decision.field] = {"choice": decision.choice, "reason": decision.reason}
        self.tracker.extra["decisions"] = self.decisions

    # -- the step -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        # The autocast weight-cast cache must be off while CUDA graphs capture (it outlives the graph).
        with _precision.autocast(
            self.precision, self.device, cache_enabled=not self.recipe.compile.cudagraphs
        ):
            yield

    def backward(self, loss: torch.Tensor | object) -> None:
        """Backward of the loss (a tensor, or a model output whose `.loss` it is)."""
        loss = loss_of(loss)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (fp16), clip, step, zero grads, close the step. Returns False when the step was
        skipped: under fp16 a gradient with inf/nan skips the update and backs the loss scale off."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        clip = self.recipe.optimizer.grad_clip
        stepped = True
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # before clipping, so the clip sees the true gradient norm
            if clip > 0:
                self.clip_grad_norm(params, clip)
            stepped = self.scaler.step(optimizer)
            self.tracker.skipped_steps += int(not stepped)
            self.tracker.extra["loss_scale"] = self.scaler.loss_scale
        else:
            if clip > 0:
                self.clip_grad_norm(params, clip)
            optimizer.step()
        self.last_step_skipped = not stepped
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.schedulers.get(id(optimizer))
        if scheduler is not None and stepped:
            scheduler.step()
        self.step_count += 1
        self.tracker.end_step()
        return stepped

    def metrics(self) -> MetricsSummary:
        summary = self.tracker.summary()
        if summary.steps:
            # Mean time a step waited for its batch: ~0 when prefetching keeps up with the step.
            summary.extra["data_wait_s_per_step"] = summary.data_wait_s / summary.steps
        if self.model is not None:
            summary.extra.update(compile_stats(self.model))
        if self.recipe.compile.mode != "off" or self.recipe.compile.cudagraphs:
            # Compilation (and graph capture) happen in the first step: what it took beyond a steady step.
            summary.extra["compile_s"] = max(0.0, summary.first_step_s - summary.step_time_s)
        return summary

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {
            "decisions": dict(self.decisions),
            "step_count": self.step_count,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "schedulers": {k: s.state_dict() for k, s in enumerate(self.schedulers.values())},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        if not isinstance(state, dict) or "step_count" not in state:
            from .checkpoint import CheckpointError

            raise CheckpointError(
                "Session.load_state_dict takes what Session.state_dict() returned (a dict with "
                f"'step_count'), not {type(state).__name__}; pass the checkpoint's session entry"
            )
        self.step_count = int(state["step_count"])  # type: ignore[arg-type]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
        for k, s in enumerate(self.schedulers.values()):
            saved = state.get("schedulers", {}).get(k)  # type: ignore[union-attr]
            if saved is not None:
                s.load_state_dict(saved)
