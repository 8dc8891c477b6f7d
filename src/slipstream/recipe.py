"""The recipe: one description of which optimizations are on.

Each component owns a nested frozen dataclass and receives only that part. Every field has a
docstring under it (torchtitan style); `describe_fields()` reads them back for `--help` and docs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from .errors import RecipeError
from .files import atomic_write_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


_UNION_ORIGINS = (Union, types.UnionType)  # Optional[X] and X | Y


@dataclass(frozen=True)
class ShapesConfig:
    mode: Literal["pad_max", "pad_batch", "bucket", "pack", "auto"] = "pad_max"
    """How variable-length sequences become fixed tensors: pad every row to max_len, pad to the
    longest in the batch, pad to planned length buckets, or pack documents into full rows. auto
    times one training step per planned shape of bucket and of pack on the model itself and takes
    the faster (bucket when the model takes no document_ids); the reason is recorded."""

    max_len: int = 1024
    """Longest row in tokens (inputs and shifted labels both have this many positions)."""

    tokens_per_batch: int = 8192
    """Token budget per batch: batch size is chosen so batch * row_len <= tokens_per_batch."""

    batch_search: Literal["auto", "off"] = "auto"
    """auto: on CUDA, when tokens_per_batch is left at its default (8192), a training step is timed
    on the user's batches at doubling budgets and the knee is kept (< 10% more tokens/s per
    doubling, memory headroom, or OOM; slipstream.batch_size); the trials are the recorded reason.
    off, or any other tokens_per_batch, pins it. CPUs are never searched."""

    overflow: Literal["error", "truncate", "split", "drop"] = "truncate"
    """What to do with a sequence longer than max_len: refuse, cut the tail, cut it into pieces,
    or skip it (dropped sequences and tokens are counted in the metrics)."""

    buckets: int | Literal["auto"] = 8
    """Number of length buckets for mode=bucket ("auto" picks it from a padding vs per-shape cost)."""

    multiple_of: int = 8
    """Round every planned row length up to a multiple of this (tensor-core and vector friendly)."""

    shape_cost_tokens: int = 262144
    """For buckets="auto": what one more distinct shape costs (a compile, CUDA-graph memory), in
    padded tokens per epoch; k minimises padded_tokens + k * shape_cost_tokens."""

    pack_algorithm: Literal["bfd", "greedy"] = "bfd"
    """mode=pack: best-fit-decreasing over a window of documents (fullest rows), or streaming
    greedy next-fit (documents in shuffled order, a row closes when the next one does not fit)."""

    pack_window: int = 4096
    """mode=pack with bfd: documents sorted and packed together; larger fills rows better."""


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16", "fp8", "auto"] = "fp32"
    """Compute dtype under autocast; weights stay fp32 (master weights). auto reads the machine
    probe: bf16 (or fp16 on CUDA) only where its matmuls measured >= 1.15x fp32's here, else fp32;
    the figures are recorded as the reason. fp8 trains Linear layers through torchao on GPUs of
    compute capability >= 8.9."""

    tf32: Literal["auto", "on", "off"] = "off"
    """fp32 matmuls and convolutions on CUDA tensor cores in TF32 (10-bit mantissa inputs, fp32
    accumulation). off (torch's default) keeps plain fp32, as a plain loop computes; on turns it on
    (CUDA only); auto turns it on where the machine probe measured TF32 matmuls >= 1.15x fp32's.
    It changes numerics: optimize tries it as a candidate judged by the parity guard."""

    loss_scale_init: float = 65536.0
    """Starting loss scale for fp16 dynamic loss scaling (ignored by other dtypes)."""

    loss_scale_growth_interval: int = 2000
    """fp16: double the loss scale after this many steps in a row without inf/nan gradients."""


@dataclass(frozen=True)
class CompileConfig:
    mode: Literal["off", "default", "max-autotune", "reduce-overhead", "auto"] = "off"
    """torch.compile mode, or off for eager. auto (CUDA): one eager step is timed and its GPU busy
    share profiled; a launch-bound step (busy < 80%) tries reduce-overhead (CUDA graphs), a busy one
    default, and the compiled model is kept only if its step is >= 1.05x faster (the figures are the
    recorded reason). On a CPU auto is off (compile's cost there is for optimize to weigh)."""

    scope: Literal["model", "blocks"] = "model"
    """Compile the whole model, or each transformer block on its own (regional: faster compile)."""

    cudagraphs: bool = False
    """CUDA only: capture forward+backward once per batch shape into a CUDA graph with static input
    buffers and replay it each step; shapes beyond cudagraph_max_shapes run eager (counted)."""

    cudagraph_max_shapes: int = 16
    """Most distinct batch shapes captured as CUDA graphs (one per planned bucket is the aim)."""

    activation_checkpointing: Literal["off", "blocks"] = "off"
    """Recompute each block's activations in backward instead of storing them (less memory, more
    compute); needs a model with a `blocks` ModuleList."""


@dataclass(frozen=True)
class KernelsConfig:
    ops: str | tuple[str, ...] = "off"
    """Fused kernels to swap in: "off", "auto" (all that apply to the device), or a tuple of names."""


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer built by Session.build_optimizer and the built-in loop."""

    lr: float = 1e-3
    """Peak learning rate."""

    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment coefficients."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each step (0 disables clipping)."""

    impl: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """Optimizer kernel implementation; auto times one step of fused, for-loop and foreach on
    copies of the model's parameters and takes the fastest (the figures are the recorded reason;
    on a 2-core CPU fused AdamW measured ~5x faster than torch's default for-loop)."""

    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps, then optimizer.schedule."""

    schedule: Literal["constant", "cosine", "linear", "one-cycle"] = "constant"
    """Learning rate after the warm-up: constant; cosine or linear decay to final_lr_ratio * lr at
    the run's last step; or one-cycle (cosine rise from lr/25 over the warm-up, 30% of the run
    when warmup_steps=0, then cosine fall to final_lr_ratio * lr). See slipstream.schedules."""

    final_lr_ratio: float = 0.1
    """cosine, linear and one-cycle: the learning rate at the last step as a fraction of lr."""


@dataclass(frozen=True)
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run: auto picks cuda when a GPU is present, else cpu."""

    seed: int = 0
    """Seed for model init, data order and every RNG the session touches."""

    deterministic: bool = False
    """Ask torch for deterministic algorithms (needed for bit-exact resume on GPU; slower)."""


@dataclass(frozen=True)
class DataflowConfig:
    prefetch: bool = False
    """Prepare batches on a background thread ahead of the step (pinned host memory and a side
    CUDA stream copy on GPU), so the step does not wait for data."""

    prefetch_depth: int = 2
    """Batches prepared ahead (bounded queue: the producer waits when it is this far ahead)."""

    workers: int = 0
    """Parallel workers for per-sample preprocessing (decode, augment); 0 prepares on one thread."""

    worker_kind: Literal["thread", "process"] = "thread"
    """Worker pool kind: threads (cheap, good when decode releases the GIL) or processes."""


@dataclass(frozen=True)
class DistributedConfig:
    strategy: Literal["ddp", "fsdp", "pipeline"] = "ddp"
    """How several processes (torchrun, `train --nproc N`) share the work: ddp (a full model per
    rank, gradients all-reduced), fsdp (FSDP2 `fully_shard` per block: parameters, gradients and
    optimizer state sharded) or pipeline (the model split into stages; built-in GPT only). Unused
    in one process."""

    batches_per_step: int = 0
    """Planned batches in one optimizer step over all ranks (the global batch); 0 means one per
    rank. Each rank accumulates batches_per_step / world_size of them (gradient sync only on the
    last). Keep it fixed to resume on another world size with the same data order and losses."""

    balance: Literal["auto", "on", "off"] = "auto"
    """Load-balanced shards: each rank's rows per step in proportion to its measured speed (ddp).
    auto turns it on when ranks' speeds differ by more than their step-to-step noise."""

    balance_every: int = 10
    """Steps between two speed measurements agreed by all ranks (a new split takes effect a few
    steps later, past what the prefetcher has already prepared)."""

    microbatches: int = 4
    """pipeline: micro-batches per global batch (bubble (p-1)/(m+p-1) for p stages)."""

    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """pipeline: the schedule (torch.distributed.pipelining)."""

    timeout_s: float = 120.0
    """Seconds a collective may wait for the other ranks before this rank exits with an error
    (a dead or hung rank ends the run instead of hanging it)."""


@dataclass(frozen=True)
class Recipe:
    name: str = "custom"
    """A label for reports; presets set it to their own name."""

    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    """Shape policy: padding, bucketing, packing."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision policy."""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile and CUDA graphs."""

    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Fused kernels swapped into the model."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer, learning rate and gradient clipping."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Device, seeds and determinism."""

    dataflow: DataflowConfig = field(default_factory=DataflowConfig)
    """Prefetching and worker pools between the data and the step."""

    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Several processes: data parallel, sharded or pipelined, with balanced shards."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def override(self, *assignments: str) -> Recipe:
        """Return a copy with `section.field=value` assignments applied (values parsed as TOML)."""
        data = self.to_dict()
        for assignment in assignments:
            path, value = _parse_assignment(assignment)
            _set_path(data, path, value)
        return recipe_from_dict(data)


# ----------------------------------------------------------------------------- validation


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _check_value(path: str, tp: Any, value: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (lists become tuples)."""
    origin = get_origin(tp)
    if _is_literal(tp):
        allowed = get_args(tp)
        if value not in allowed:
            raise RecipeError(
                f"{path}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}"
            )
        return value
    if origin in _UNION_ORIGINS:
        errors = []
        for option in get_args(tp):
            try:
                return _check_value(path, option, value)
            except RecipeError as err:
                errors.append(str(err))
        raise RecipeError(f"{path}={value!r} fits none of the allowed forms: " + "; ".join(errors))
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}={value!r} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_value(f"{path}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecipeError(f"{path}={value!r} must have {len(args)} items")
        return tuple(_check_value(f"{path}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = (
                " (write it without a decimal point or exponent, e.g. 1024)"
                if isinstance(value, float)
                else ""
            )
            raise RecipeError(f"{path}={value!r} must be an integer{hint}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}={value!r} must be a number")
        if not math.isfinite(value):  # nan passes every range check below; inf is no setting
            raise RecipeError(f"{path}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{path}={value!r} must be a string")
        return value
    return value


MAX_ROW_TOKENS = 1 << 24
"""Upper bound of shapes.max_len (16,777,216 tokens per row): above it a value is a typo, and the
built-in GPT's position table alone would not fit in memory."""

_RANGES: dict[str, tuple[float, float | None]] = {
    "shapes.max_len": (2, MAX_ROW_TOKENS),
    "shapes.tokens_per_batch": (1, 1 << 40),
    "shapes.multiple_of": (1, None),
    "shapes.shape_cost_tokens": (0, None),
    "shapes.pack_window": (1, None),
    "optimizer.lr": (0.0, None),
    "optimizer.weight_decay": (0.0, None),
    "optimizer.grad_clip": (0.0, None),
    "optimizer.warmup_steps": (0, None),
    "optimizer.final_lr_ratio": (0.0, 1.0),
    "precision.loss_scale_init": (1.0, None),
    "precision.loss_scale_growth_interval": (1, None),
    "compile.cudagraph_max_shapes": (1, None),
    "dataflow.prefetch_depth": (1, None),
    "dataflow.workers": (0, None),
    "distributed.batches_per_step": (0, None),
    "distributed.balance_every": (1, None),
    "distributed.microbatches": (1, None),
    "distributed.timeout_s": (1.0, None),
}


def _check_range(path: str, value: Any) -> None:
    if path in _RANGES:
        lo, hi = _RANGES[path]
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise RecipeError(f"{path}={value!r} is out of range; use a value {bound}")
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        # every count ends up in a tensor size or an int64
        raise RecipeError(f"{path}={value!r} is out of range; use a value below 2**63")


def check_field(path: str, value: Any) -> Any:
    """`value` for the recipe field `path` ('section.field'), checked as a recipe checks it (type,
    then range); returns it. For arguments that override a field (prepare_loader's max_len)."""
    section, name = path.split(".")
    tp = typing.get_type_hints(typing.get_type_hints(Recipe)[section])[name]
    checked = _check_value(path, tp, value)
    _check_range(path, checked)
    return checked


def validate(recipe: Recipe) -> None:
    hints = typing.get_type_hints(Recipe)
    for f in fields(Recipe):
        value = getattr(recipe, f.name)
        if f.name == "name":
            _check_value("name", str, value)
            continue
        section_type = hints[f.name]
        if not isinstance(value, section_type):
            raise RecipeError(f"{f.name} must be a {section_type.__name__}, got {type(value).__name__}")
        section_hints = typing.get_type_hints(section_type)
        for sf in fields(section_type):
            path = f"{f.name}.{sf.name}"
            checked = _check_value(path, section_hints[sf.name], getattr(value, sf.name))
            if checked != getattr(value, sf.name) or type(checked) is not type(getattr(value, sf.name)):
                object.__setattr__(value, sf.name, checked)
            _check_range(path, checked)
    k = recipe.shapes.buckets
    if isinstance(k, int) and k < 1:
        raise RecipeError(f"shapes.buckets={k!r} must be >= 1 or 'auto'")
    ops = recipe.kernels.ops
    if isinstance(ops, str) and ops not in ("off", "auto"):
        raise RecipeError(f"kernels.ops={ops!r}: use 'off', 'auto' or a list of op names")


# ----------------------------------------------------------------------------- (de)serialisation


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Build a Recipe from plain data, rejecting unknown sections and fields by name."""
    if not isinstance(data, dict):
        raise RecipeError("a recipe must be a table/object of sections")
    hints = typing.get_type_hints(Recipe)
    known = {f.name for f in fields(Recipe)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise RecipeError(f"unknown recipe section {key!r}; known: {', '.join(sorted(known))}")
        if key == "name":
            kwargs[key] = value
            continue
        section_type = hints[key]
        if not isinstance(value, dict):
            raise RecipeError(f"recipe section {key!r} must be a table of fields")
        section_fields = {f.name for f in fields(section_type)}
        for fname in value:
            if fname not in section_fields:
                raise RecipeError(
                    f"unknown field {key}.{fname}; fields of {key}: {', '.join(sorted(section_fields))}"
                )
        section_hints = typing.get_type_hints(section_type)
        coerced = {k: _check_value(f"{key}.{k}", section_hints[k], v) for k, v in value.items()}
        kwargs[key] = section_type(**coerced)
    return Recipe(**kwargs)


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load a recipe from a .toml or .json file."""
    p = Path(path)
    if not p.exists():
        raise RecipeError(f"recipe file {str(p)!r} does not exist")
    if p.is_dir():
        raise RecipeError(f"recipe {str(p)!r} is a folder; give a .toml or .json recipe file")
    if p.suffix not in (".json", ".toml"):
        raise RecipeError(f"recipe file {str(p)!r} must end in .toml or .json")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as err:
        why = "nesting too deep" if isinstance(err, RecursionError) else str(err).splitlines()[0]
        raise RecipeError(
            f"recipe file {str(p)!r} is not valid {p.suffix[1:].upper()} ({why}); fix it or write a "
            "fresh one with `slipstream recipe PRESET --save FILE`"
        ) from None
    if isinstance(data, dict) and "name" not in data:
        data["name"] = p.stem
    return recipe_from_dict(data)


def save_recipe(recipe: Recipe, path: str | os.PathLike[str]) -> Path:
    """Write a recipe as .toml or .json atomically (temp file, then rename)."""
    p = Path(path)
    data = recipe.to_dict()
    if p.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    elif p.suffix == ".toml":
        import tomli_w

        text = tomli_w.dumps(data)
    else:
        raise RecipeError(f"recipe file {str(p)!r} must end in .toml or .json")
    atomic_write_text(p, text)
    return p


def _parse_assignment(assignment: str) -> tuple[list[str], Any]:
    if not isinstance(assignment, str):
        raise RecipeError(f"override {assignment!r} must be a 'section.field=value' string")
    if "=" not in assignment:
        raise RecipeError(f"override {assignment!r} must look like section.field=value")
    key, raw = assignment.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise RecipeError(f"override {assignment!r} must name section.field (e.g. precision.dtype=bf16)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # bare words such as bf16 or pad_max
    return path, value


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    section, name = path
    if section not in data or not isinstance(data[section], dict):
        known = sorted(k for k, v in data.items() if isinstance(v, dict))
        raise RecipeError(f"unknown recipe section {section!r}; known: {', '.join(known)}")
    if name not in data[section]:
        raise RecipeError(
            f"unknown field {section}.{name}; fields of {section}: {', '.join(sorted(data[section]))}"
        )
    data[section][name] = value


# ----------------------------------------------------------------------------- field docs


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """(path, type, default, docstring) for every recipe field, read from the source."""
    rows = []
    default = Recipe()
    for f in fields(Recipe):
        if f.name == "name":
            continue
        section = getattr(default, f.name)
        docs = _field_docstrings(type(section))
        hints = typing.get_type_hints(type(section))
        for sf in fields(section):
            tp = hints[sf.name]
            rows.append(
                (f"{f.name}.{sf.name}", _type_name(tp), getattr(section, sf.name), docs.get(sf.name, ""))
            )
    return rows


def _type_name(tp: Any) -> str:
    if _is_literal(tp):
        return " | ".join(map(str, get_args(tp)))
    if get_origin(tp) in _UNION_ORIGINS:
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return "list"
    return getattr(tp, "__name__", str(tp))


def _field_docstrings(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


__all__ = [
    "Recipe",
    "RecipeError",
    "ShapesConfig",
    "PrecisionConfig",
    "CompileConfig",
    "KernelsConfig",
    "OptimizerConfig",
    "RuntimeConfig",
    "DataflowConfig",
    "load_recipe",
    "save_recipe",
    "recipe_from_dict",
    "describe_fields",
]
