"""Fewer launches and less memory: torch.compile, CUDA graphs per batch shape, activation checkpointing.

Each is an ordered plain function over the model instance the user handed us (torchtitan style):
`apply_activation_checkpointing` → `apply_compile` → `apply_cudagraphs`. None of them changes the
keys of the model's state_dict: regional compile and checkpointing work in place, and the CUDA
graph wrapper keeps the model under `_orig_mod`, as torch.compile's wrapper does, so loops that
unwrap with `getattr(model, "_orig_mod", model)` save the same checkpoint either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .recipe import CompileConfig, RecipeError

# ----------------------------------------------------------------------------- torch.compile


def _blocks(model: nn.Module, field: str) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise RecipeError(
            f"{field} needs a model with a `blocks` ModuleList ({type(model).__name__} has none); "
            + ("use compile.scope=model" if field == "compile.scope=blocks" else "set it to off")
        )
    return blocks


def apply_compile(model: nn.Module, cfg: CompileConfig, *, backend: str | None = None) -> nn.Module:
    """torch.compile the whole model, or each block on its own (regional: compiles once per block
    type, so compile time does not grow with depth). In place: state_dict keys stay the same.

    `backend` overrides inductor (tests use "aot_eager" to check the plumbing without codegen)."""
    if cfg.mode == "off":
        return model
    options: dict[str, str] = {"backend": backend} if backend is not None else {"mode": cfg.mode}
    if cfg.scope == "blocks":
        for block in _blocks(model, "compile.scope=blocks"):
            block.compile(**options)
        return model
    model.compile(**options)
    return model


# ----------------------------------------------------------------------------- activation checkpointing


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(block).forward
    if not torch.is_grad_enabled():  # evaluation: nothing is stored, nothing to recompute
        return forward(block, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, block, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Recompute each block's activations during backward instead of keeping them; returns how many
    blocks were wrapped. Sets `forward` on each block instance (a partial, so deepcopy follows it)."""
    if mode == "off":
        return 0
    blocks = _blocks(model, "compile.activation_checkpointing=blocks")
    for block in blocks:
        block.forward = functools.partial(_checkpointed_forward, block)
    return len(blocks)


# ----------------------------------------------------------------------------- CUDA graphs per shape

Capture = Callable[[nn.Module, tuple[Tensor, ...]], Callable[..., Any]]


class _Positional(nn.Module):
    """model(**batch) as a function of positional tensors, the form make_graphed_callables takes."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *tensors: Tensor) -> Tensor:
        return self.model(**dict(zip(self.names, tensors)))


def capture_cuda_graph(fn: nn.Module, sample_args: tuple[Tensor, ...]) -> Callable[..., Any]:
    """Capture forward and backward of `fn` for these input shapes (warm-up runs on a side stream).

    Each shape gets its own memory pool: a pool shared between shapes would let one shape's
    replay overwrite another's gradients if a loop ever accumulated across shapes.
    """
    return torch.cuda.make_graphed_callables(fn, sample_args, num_warmup_iters=3, allow_unused_input=True)


class CUDAGraphModel(nn.Module):
    """Replays one CUDA graph per batch shape; eager for shapes past the budget or outside training.

    Inputs are copied into the graph's static buffers by the replay; the output (the loss) is
    cloned because the graph overwrites its static output on the next replay. Requirements: the
    model's forward returns one tensor, parameters are not reassigned after capture, and grads are
    set to None between steps (`zero_grad(set_to_none=True)`, as Session.step does) because the
    replayed backward hands out gradients that live in the graph's buffers.
    """

    def __init__(self, model: nn.Module, max_shapes: int = 16, capture: Capture | None = None):
        super().__init__()
        if capture is None and not torch.cuda.is_available():
            raise RecipeError("compile.cudagraphs=true needs CUDA; set compile.cudagraphs=false on CPU")
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes} must be >= 1")
        self._orig_mod = model
        self.max_shapes = max_shapes
        self._capture = capture or capture_cuda_graph
        self._graphs: dict[tuple, Callable[..., Any]] = {}
        self.captures = 0
        """Shapes captured so far (one capture per shape)."""
        self.replays = 0
        """Training steps served by a graph replay."""
        self.eager_fallbacks = 0
        """Training steps run eagerly because their shape arrived after max_shapes were captured."""

    @staticmethod
    def _key(batch: dict[str, Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))

    def forward(self, **batch: Any) -> Tensor:
        tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
        if len(tensors) != len(batch):
            others = sorted(set(batch) - set(tensors))
            raise TypeError(f"CUDA graphs replay tensor inputs only; got non-tensor arguments {others}")
        if not (self.training and torch.is_grad_enabled()):
            return self._orig_mod(**batch)  # evaluation runs eager: graphs hold the training step
        key = self._key(tensors)
        graphed = self._graphs.get(key)
        if graphed is None:
            if len(self._graphs) >= self.max_shapes:
                self.eager_fallbacks += 1
                return self._orig_mod(**batch)
            names = tuple(name for name, _, _ in key)
            sample = tuple(tensors[n] for n in names)
            graphed = self._capture(_Positional(self._orig_mod, names), sample)
            self._graphs[key] = graphed
            self.captures += 1
        else:
            self.replays += 1
        names = tuple(name for name, _, _ in key)
        out = graphed(*(tensors[n] for n in names))
        return out.clone()

    def stats(self) -> dict[str, int]:
        return {
            "cudagraph_captures": self.captures,
            "cudagraph_replays": self.replays,
            "cudagraph_eager_fallbacks": self.eager_fallbacks,
        }


def apply_cudagraphs(model: nn.Module, cfg: CompileConfig, device: torch.device) -> nn.Module:
    if not cfg.cudagraphs:
        return model
    if device.type != "cuda":
        raise RecipeError("compile.cudagraphs=true needs CUDA; set compile.cudagraphs=false on CPU")
    if cfg.mode != "off":
        raise RecipeError(
            f"compile.cudagraphs=true with compile.mode={cfg.mode}: torch.compile graphs are not captured "
            "by slipstream; use compile.mode=reduce-overhead (CUDA graphs inside torch.compile) "
            "or compile.mode=off"
        )
    return CUDAGraphModel(model, cfg.cudagraph_max_shapes)


def compile_stats(model: nn.Module) -> dict[str, int]:
    """Counters of the CUDA graph wrapper, if the model has one (metrics read them, never the reverse)."""
    return model.stats() if isinstance(model, CUDAGraphModel) else {}


__all__ = [
    "CUDAGraphModel",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_cudagraphs",
    "capture_cuda_graph",
    "compile_stats",
]
