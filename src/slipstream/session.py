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

Optimizations are applied to the model by ordered plain functions (`apply_kernels`,
`apply_compile`), each reading only its own part of the recipe.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from .metrics import MetricsSummary, MetricsTracker
from .recipe import CompileConfig, KernelsConfig, OptimizerConfig, PrecisionConfig, Recipe, RecipeError
from .shapes.loader import ShapedLoader

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RecipeError("runtime.device=cuda but no CUDA device is visible; use runtime.device=auto or cpu")
    return torch.device(choice)


def resolve_precision(cfg: PrecisionConfig, device: torch.device) -> str:
    """The dtype actually used; `auto` picks the cheapest one the device runs well."""
    dtype = cfg.dtype
    if dtype == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16"  # CPU autocast bf16 uses native bf16 matmuls where the CPU has them
    if dtype == "fp16" and device.type != "cuda":
        raise RecipeError("precision.dtype=fp16 needs CUDA (CPU fp16 matmuls are slow); use bf16 on CPU")
    if dtype == "fp8":
        raise RecipeError("precision.dtype=fp8 is not implemented yet; use bf16")
    return dtype


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def apply_kernels(model: nn.Module, cfg: KernelsConfig, device: torch.device) -> dict[str, object]:
    """Swap fused kernels into this model instance; returns what was swapped."""
    if cfg.ops == "off":
        return {}
    from . import kernels  # lazy: Triton is optional

    report = kernels.apply_kernels(model, cfg.ops, device)
    return {"kernels_swapped": dict(report.swapped), "kernels_backend": report.backend}


def apply_compile(model: nn.Module, cfg: CompileConfig) -> nn.Module:
    """torch.compile the whole model, or each block on its own (regional: compiles once per block type)."""
    if cfg.mode == "off":
        return model
    options = {"mode": cfg.mode}
    if cfg.scope == "blocks":
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise RecipeError("compile.scope=blocks needs a model with a `blocks` ModuleList; use compile.scope=model")
        for block in blocks:
            block.compile(**options)
        return model
    model.compile(**options)
    return model


def build_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay matrices only; biases, norms and embeddings' 1-D params are not decayed (GPT-2 practice)."""
    seen, decay, no_decay = set(), [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    impl: dict[str, bool] = {}
    if cfg.impl == "fused":
        impl = {"fused": True}
    elif cfg.impl == "foreach":
        impl = {"foreach": True}
    elif cfg.impl == "for-loop":
        impl = {"foreach": False}
    groups = build_param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **impl)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, **impl)


def _accepts_document_ids(model: nn.Module) -> bool:
    model = getattr(model, "_orig_mod", model)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "document_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Session:
    def __init__(self, recipe: Recipe | None = None):
        self.recipe = recipe if recipe is not None else Recipe()
        self.device = resolve_device(self.recipe.runtime.device)
        self.precision = resolve_precision(self.recipe.precision, self.device)
        seed_everything(self.recipe.runtime.seed, self.recipe.runtime.deterministic)
        self.tracker = MetricsTracker(self.device, self.precision)
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.schedulers: dict[int, torch.optim.lr_scheduler.LRScheduler] = {}
        self.model: nn.Module | None = None
        self.step_count = 0

    # -- preparation ----------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        self.tracker.extra.update(apply_kernels(model, self.recipe.kernels, self.device))
        model = apply_compile(model, self.recipe.compile)
        self.tracker.extra["compiled"] = self.recipe.compile.mode != "off"
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The recipe's optimizer over `model`, already prepared."""
        return self.prepare_optimizer(build_optimizer(model, self.recipe.optimizer, self.device))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        warmup = self.recipe.optimizer.warmup_steps
        if warmup > 0:
            self.schedulers[id(optimizer)] = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, (step + 1) / warmup)
            )
        return optimizer

    def prepare_loader(
        self,
        sequences: Sequence,
        tokens_per_batch: int | None = None,
        max_len: int | None = None,
        *,
        pad_id: int = 0,
        rank: int = 0,
        world_size: int = 1,
        lengths: np.ndarray | None = None,
    ) -> ShapedLoader:
        """Batches of `sequences` (1-D token id lists) shaped by recipe.shapes; arguments override it."""
        from dataclasses import replace

        cfg = self.recipe.shapes
        if cfg.mode in ("pack", "auto"):
            cfg = replace(cfg, mode=self._resolve_packing(cfg.mode))
        if tokens_per_batch is not None:
            cfg = replace(cfg, tokens_per_batch=tokens_per_batch)
        if max_len is not None:
            cfg = replace(cfg, max_len=max_len)
        loader = ShapedLoader(
            sequences,
            cfg,
            seed=self.recipe.runtime.seed,
            device=self.device,
            pad_id=pad_id,
            rank=rank,
            world_size=world_size,
            lengths=lengths,
            on_batch=self.tracker.on_batch,
        )
        self.tracker.extra["shape_policy"] = loader.policy.name
        self.tracker.extra["overflowed_sequences"] = loader.overflow.overflowed
        self.tracker.extra["truncated_tokens"] = loader.overflow.dropped_tokens
        return loader

    def _resolve_packing(self, mode: str) -> str:
        """pack needs a model that masks attention by document; auto falls back to bucket (recorded)."""
        accepts = self.model is None or _accepts_document_ids(self.model)
        if mode == "pack" and not accepts:
            raise RecipeError(
                f"shapes.mode=pack needs a model whose forward takes document_ids, and "
                f"{type(self.model).__name__}.forward does not; use shapes.mode=bucket (or auto)"
            )
        chosen = "pack" if accepts else "bucket"
        if mode == "auto":
            self.tracker.extra["shape_mode_auto_choice"] = chosen
        return chosen

    # -- the step -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale (fp16), clip, step (skipped on overflow under fp16), zero grads, close the step."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        clip = self.recipe.optimizer.grad_clip
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            scale_before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale_before:  # GradScaler backs off only on inf/nan: step skipped
                self.tracker.skipped_steps += 1
            self.tracker.extra["loss_scale"] = self.scaler.get_scale()
        else:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.schedulers.get(id(optimizer))
        if scheduler is not None:
            scheduler.step()
        self.step_count += 1
        self.tracker.end_step()

    def metrics(self) -> MetricsSummary:
        return self.tracker.summary()

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {
            "step_count": self.step_count,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "schedulers": {k: s.state_dict() for k, s in enumerate(self.schedulers.values())},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step_count = int(state["step_count"])  # type: ignore[arg-type]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
        for k, s in enumerate(self.schedulers.values()):
            saved = state.get("schedulers", {}).get(k)  # type: ignore[union-attr]
            if saved is not None:
                s.load_state_dict(saved)
