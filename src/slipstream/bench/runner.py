"""Side-by-side benchmark of recipes (and peers) on one workload, interleaved round by round.

Method (torch.utils.benchmark / MLPerf style):
- every contender is built once and warmed up (compile happens there; timed as compile_s),
- then rounds run A B C A B C ...: in each round every contender trains until it has consumed the
  same budget of *real* tokens, so drift on a noisy machine hits all of them alike and each sees
  the same amount of learning signal,
- figures are medians over rounds with the interquartile range; IQR/median > 0.1 is flagged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..metrics import dynamo_graph_count
from ..models import loss_of
from ..parity import judge_parity, noise_band
from ..presets import resolve_recipe
from ..recipe import Recipe, RecipeError
from ..runtime import resolve_device
from ..session import Session
from ..shapes.loader import Batch, ShapedLoader
from ..train import evaluate
from ..workloads import get_workload
from .contenders import (
    Contender,
    LoopContender,
    RoundStats,
    matched_loader,
    real_tokens_per_step,
)
from .memory import CudaMemory, peak_memory_in_subprocess
from .mfu import model_flops_per_token, peak_flops_from_probe

NOISY_IQR_RATIO = 0.1


@dataclass
class ContenderResult:
    name: str
    kind: str
    """"recipe" or "peer"."""
    real_tokens_per_s: float
    """Median over rounds."""
    real_tokens_per_s_iqr: float
    round_tokens_per_s: list[float]
    speedup: float
    """real_tokens_per_s over the first contender's."""
    step_time_s: float
    padding_waste: float
    data_wait_s: float
    distinct_shapes: int
    recompiles: int
    compile_s: float
    """Warm-up time beyond its steps' steady cost: compilation, autotuning, first allocations."""
    peak_memory_bytes: int | None
    peak_memory_note: str
    real_tokens: int
    steps: int
    val_loss: float
    parity_gap: float
    """Relative gap of the final validation loss to the reference (first) contender's."""
    parity: str
    """"pass", "fail", or "reference"."""
    mfu: float
    """Model FLOP/s over the peak matmul rate measured in this run: the model's own training FLOPs
    per token (`flops_per_token`, the built-in GPT's PaLM formula, attention term at the recipe's
    max_len: an upper bound for bucketed rows), else 6 x parameters, per real token."""
    precision: str
    noisy: bool
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    """(cumulative real tokens, training loss) per step."""
    time_breakdown_s: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResult:
    workload: str
    size: str
    machine: dict[str, Any]
    method: dict[str, Any]
    peak_flops: dict[str, float]
    contenders: list[ContenderResult]
    skipped: dict[str, str]
    """Contenders that could not run, with the reason."""
    warnings: list[str]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (tuples become lists), exactly what --json writes."""
        return json.loads(json.dumps(asdict(self)))


class RecipeContender(LoopContender):
    """A recipe run through Session: the way a slipstream user trains."""

    def __init__(
        self,
        spec: str,
        workload: str,
        size: str,
        data,
        val_batches: int,
        reference: Recipe,
        *,
        real_tokens_per_step: float | None = None,
        name: str | None = None,
    ):
        self.name = name or spec
        self.recipe: Recipe = resolve_recipe(spec)
        self.spec = spec
        self.session = Session(self.recipe)
        self.precision = self.session.precision
        wl = get_workload(workload)
        self.model = self.session.prepare_model(wl.model(size, self.recipe.shapes.max_len))
        self.optimizer = self.session.build_optimizer(self.model)

        def loader(tokens_per_batch: int | None):
            return self.session.prepare_loader(
                data.train, tokens_per_batch, lengths=data.train_lengths, pad_id=data.pad_id
            )

        shapes = self.recipe.shapes
        self.loader = matched_loader(loader, shapes.tokens_per_batch, real_tokens_per_step, shapes.max_len)
        self.batches = self.loader.forever()
        self.val_loader = ShapedLoader(
            data.validation,
            replace(reference.shapes, mode="pad_max"),  # one fixed validation shape for every contender
            device=self.session.device,
            pad_id=data.pad_id,
            lengths=data.validation_lengths,
            convention=self.session.convention,
        )
        self.val_batches = val_batches
        self.device = self.session.device
        self.shapes_seen = set()

    def train_step(self, batch: Batch) -> torch.Tensor:
        with self.session.autocast():
            loss = loss_of(self.model(**batch))
        self.session.backward(loss)
        self.session.step(self.optimizer)
        return loss

    def round_mark(self) -> int:
        return len(self.session.tracker.records)

    def data_wait_since(self, mark: int) -> float:
        return sum(r.data_wait_s for r in self.session.tracker.records[mark:])

    def validation_loss(self) -> float:
        return evaluate(self.model, self.val_loader, self.session, self.val_batches)

    def info(self) -> dict[str, Any]:
        m = self.session.metrics()
        decisions = self.session.decisions
        return {
            "distinct_shapes": m.distinct_shapes,
            "recompiles": m.recompiles,
            "recipe": self.recipe.to_dict(),
            **({"decisions_list": [{"field": k, **v} for k, v in decisions.items()]} if decisions else {}),
            **{k: v for k, v in m.extra.items() if isinstance(v, (int, float, str, bool))},
        }


def custom_factory(cls: type[RecipeContender]) -> Callable[..., RecipeContender]:
    """The `run_bench(custom=...)` factory for a RecipeContender subclass: the contender named
    `label@recipe-spec` is built from that recipe, matched like the others, and keeps its label."""

    def build(spec, workload, size, data, val_batches, reference, target) -> RecipeContender:
        return cls(
            spec.split("@", 1)[1], workload, size, data, val_batches, reference,
            real_tokens_per_step=target, name=spec,
        )  # fmt: skip

    return build


def _iqr(values: list[float]) -> float:
    q75, q25 = np.percentile(values, [75, 25])
    return float(q75 - q25)


def _failure(what: str, err: BaseException) -> str:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return f"{what}: {type(err).__name__}: {first}"


SLOW_DTYPE_FACTOR = 4.0
"""By default a contender whose dtype's matmuls measured this many times slower than fp32 is skipped
(with the probe's figures as the reason): on an AVX2 CPU bf16 is ~75x slower and would hold the
whole benchmark for half an hour to prove what the probe measured in a second."""


def dtype_skip_reason(recipe: Recipe, min_dtype_speed: float) -> str | None:
    """Why a recipe that forces a cheaper dtype is not run here (None: run it): the probe measured
    that dtype's matmuls below `min_dtype_speed` x fp32's. `auto` is never skipped: it already
    decides by the probe."""
    from ..decisions import too_slow
    from ..machine import probe

    dtype = recipe.precision.dtype
    if dtype not in ("bf16", "fp16"):
        return None
    why = too_slow(probe(resolve_device(recipe.runtime.device)), dtype, min_dtype_speed)
    return None if why is None else f"{why}; pass --all-dtypes to run it anyway"


def run_bench(
    workload: str = "gpt-stdlib",
    recipes: list[str] | None = None,
    *,
    size: str = "tiny",
    rounds: int = 3,
    round_tokens: int | None = None,
    warmup_steps: int = 2,
    val_batches: int = 4,
    peers: list[str] | None = None,
    memory: str = "auto",
    parity_floor: float = 0.002,
    noise_seeds: int = 2,
    match_steps: bool = True,
    min_dtype_speed: float | None = 1 / SLOW_DTYPE_FACTOR,
    max_round_s: float | None = None,
    real_tokens_per_step_target: float | None = None,
    custom: dict[str, Callable[..., Contender]] | None = None,
    tolerate_failures: bool = False,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark recipes (and peers) side by side; the first contender is the reference.

    With `match_steps` every contender's batches carry the reference's real tokens per optimizer
    step (its token budget per batch is rescaled), so equal real-token budgets mean equal steps and
    the validation losses compare the same training. Parity is judged against the spread of
    `noise_seeds` extra runs of the reference with other seeds (see `noise_band`). A recipe that
    forces a dtype the probe measured below `min_dtype_speed` x fp32 is skipped with the figures
    (None runs every dtype).
    `real_tokens_per_step_target` sets the matched figure instead of taking the first contender's
    (optimize does, so that every stage trains like its original reference). `custom` maps a name
    in `recipes`, written `label@recipe-spec` (the recipe it starts from), to a factory `(spec, workload, size, data, val_batches, reference, target)` for
    contenders no recipe can express (benchmarks/parity.py's deliberately broken ones). With
    `tolerate_failures` a contender (other than the reference) that fails to build, runs out of
    memory or crashes mid-round is dropped and listed under `skipped` with the error; the rest go on
    (optimize relies on this: a broken candidate is a rejected candidate, not a failed search)."""
    from .peers import PEERS, PeerUnavailable

    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    recipes = recipes or ["baseline"]
    if rounds < 1:
        raise RecipeError(f"rounds={rounds} must be at least 1")
    if noise_seeds < 0:
        raise RecipeError(f"noise_seeds={noise_seeds} must be >= 0")
    custom = custom or {}
    # fail fast on a bad spec, before any work (a custom contender names the recipe it starts from)
    specs = [resolve_recipe(s.split("@", 1)[-1] if s in custom else s) for s in recipes]
    for peer in peers or []:
        if peer not in PEERS:
            raise RecipeError(f"unknown peer {peer!r}; available: {', '.join(sorted(PEERS))}")
    wl = get_workload(workload)
    if size not in wl.sizes:
        raise RecipeError(f"workload {workload!r} has no size {size!r}; choose one of {', '.join(wl.sizes)}")
    data = wl.load_data()
    budget = round_tokens or 2 * specs[0].shapes.tokens_per_batch

    contenders: list[Contender] = []
    skipped: dict[str, str] = {}
    cuda_memory = CudaMemory(resolve_device(specs[0].runtime.device))
    target: float | None = real_tokens_per_step_target if match_steps else None
    for spec, recipe in zip(recipes, specs):
        why = None
        if min_dtype_speed is not None and spec != recipes[0]:
            why = dtype_skip_reason(recipe, min_dtype_speed)
        if why:
            say(f"skipping {spec}: {why}")
            skipped[spec] = why
            continue
        say(f"building {spec}")
        since = cuda_memory.allocated()
        try:
            if spec in custom:
                c = custom[spec](spec, workload, size, data, val_batches, specs[0], target)
            else:
                c = RecipeContender(
                    spec, workload, size, data, val_batches, specs[0], real_tokens_per_step=target
                )
        except Exception as err:
            if not tolerate_failures or spec == recipes[0]:
                raise
            skipped[spec] = _failure("failed to build", err)
            say(f"skipping {spec}: {skipped[spec]}")
            continue
        contenders.append(c)
        cuda_memory.keep(c.name, since)
        if match_steps and target is None:
            target = real_tokens_per_step(c.loader)
    noise: list[Contender] = []
    base_seed = specs[0].runtime.seed
    for k in range(1, noise_seeds + 1):
        spec = f"{recipes[0]}+runtime.seed={base_seed + k}"
        say(f"building {spec} (noise band)")
        noise.append(
            RecipeContender(spec, workload, size, data, val_batches, specs[0], real_tokens_per_step=target)
        )
    for peer in peers or []:
        try:
            say(f"building peer {peer}")
            contenders.append(PEERS[peer](workload, size, data, specs[0], val_batches, target))
        except PeerUnavailable as why:
            skipped[peer] = str(why)

    everyone = contenders + noise
    try:
        device = getattr(contenders[0], "device", torch.device("cpu"))
        warm: dict[str, float] = {}
        # dynamo's graph counter is process-wide, so each contender's recompiles are the graphs built
        # while it alone was running, after its first step.
        recompiles: dict[str, int] = {c.name: 0 for c in everyone}
        capped: set[str] = set()
        failed: set[str] = set()

        def counted_round(
            c: Contender, budget: int | None, max_steps: int | None = None
        ) -> RoundStats | None:
            before = dynamo_graph_count()
            try:
                stats = c.run_round(budget, max_steps=max_steps, max_seconds=max_round_s)
            except Exception as err:  # out of memory, a crash in a kernel or compiler
                if not tolerate_failures or c is contenders[0]:
                    raise
                skipped[c.name] = _failure("failed while training", err)
                say(f"dropping {c.name}: {skipped[c.name]}")
                failed.add(c.name)
                return None
            recompiles[c.name] += dynamo_graph_count() - before
            if budget is not None and stats.real_tokens < budget:
                capped.add(c.name)
            return stats

        for c in everyone:
            say(f"warm-up {c.name}")
            t0 = time.perf_counter()
            since = cuda_memory.allocated()
            first = counted_round(c, None, 1)
            recompiles[c.name] = 0  # the first step's graphs are compiles, not recompiles
            if first is not None and warmup_steps > 1:
                counted_round(c, None, warmup_steps - 1)
            warm[c.name] = time.perf_counter() - t0
            cuda_memory.keep(c.name, since)  # optimizer state, CUDA graph pools: created by the first steps

        per_round: dict[str, list[RoundStats]] = {c.name: [] for c in everyone}
        for r in range(rounds):
            for c in everyone:  # interleaved: A B C A B C ...
                if c.name in failed:
                    continue
                with cuda_memory.round(c.name):
                    st = counted_round(c, budget)
                if st is None:
                    continue
                per_round[c.name].append(st)
                say(
                    f"round {r + 1}/{rounds} {c.name}: {st.real_tokens / st.seconds:,.0f} real tok/s "
                    f"({st.steps} steps, {st.seconds:.1f} s)"
                )

        say("reading the peak matmul rate (machine probe)")
        peak = peak_flops_from_probe(device)
        noise_losses = []
        contenders = [c for c in contenders if c.name not in failed]
        for c in noise:
            if c.name in failed:
                continue
            say(f"validation {c.name}")
            noise_losses.append(c.validation_loss())
        results: list[ContenderResult] = []
        warnings: list[str] = []
        ref_val: float | None = None
        band = 0.0
        for c in contenders:
            stats = per_round[c.name]
            tps = [s.real_tokens / s.seconds for s in stats]
            med = float(np.median(tps))
            steps = sum(s.steps for s in stats)
            seconds = sum(s.seconds for s in stats)
            real = sum(s.real_tokens for s in stats)
            padded = sum(s.padded_tokens for s in stats)
            step_time = seconds / max(steps, 1)
            say(f"validation {c.name}")
            val = c.validation_loss()
            if ref_val is None:
                ref_val = val
                band = noise_band([val, *noise_losses])
            verdict, gap, _ = judge_parity(val, ref_val, band, parity_floor)
            if c is contenders[0]:
                verdict = "reference"
            elif c.name in capped:
                verdict = "unjudged"
                warnings.append(
                    f"{c.name}: rounds cut at {max_round_s:.0f} s before the token budget; parity not judged"
                )
            info = c.info()
            row_len = info.get("recipe", {}).get("shapes", {}).get("max_len", 0)
            mfu = (
                med
                * model_flops_per_token(getattr(c, "model", None), row_len)
                / peak.get(c.precision, peak["fp32"])
            )
            noisy = med > 0 and _iqr(tps) / med > NOISY_IQR_RATIO
            if noisy:
                warnings.append(
                    f"{c.name}: IQR/median of tokens/s is {_iqr(tps) / med:.2f} (> {NOISY_IQR_RATIO}); rerun with more rounds"
                )
            mem, note = None, "not measured"
            if c.kind == "recipe":
                if device.type == "cuda":
                    mem = cuda_memory.peak(c.name)
                    note = "cuda_max_allocated: bytes it keeps + its rounds' most above their start (as if alone)"
                elif memory in ("auto", "subprocess"):
                    say(f"peak memory {c.name}")
                    mem, note = peak_memory_in_subprocess(c.name, workload, size)
            cum, curve = 0, []
            per_step_tokens = real / max(steps, 1)
            for st in stats:
                for loss in st.losses:
                    cum += per_step_tokens
                    curve.append((int(cum), loss))
            data_wait = sum(st.data_wait_s for st in stats)
            results.append(
                ContenderResult(
                    name=c.name,
                    kind=c.kind,
                    real_tokens_per_s=med,
                    real_tokens_per_s_iqr=_iqr(tps),
                    round_tokens_per_s=tps,
                    speedup=0.0,
                    step_time_s=step_time,
                    padding_waste=padded / (real + padded) if real + padded else 0.0,
                    data_wait_s=data_wait,
                    distinct_shapes=int(info.get("distinct_shapes", 0)),
                    recompiles=recompiles[c.name],
                    compile_s=max(0.0, warm[c.name] - warmup_steps * step_time),
                    peak_memory_bytes=mem,
                    peak_memory_note=note,
                    real_tokens=real,
                    steps=steps,
                    val_loss=val,
                    parity_gap=gap if math.isfinite(gap) else 1e9,
                    parity=verdict,
                    mfu=mfu,
                    precision=c.precision,
                    noisy=noisy,
                    loss_curve=curve,
                    time_breakdown_s={"compute": max(0.0, seconds - data_wait), "data_wait": data_wait},
                    info={k: v for k, v in info.items() if k not in ("distinct_shapes", "recompiles")},
                )
            )
        base = results[0].real_tokens_per_s
        for r in results:
            r.speedup = r.real_tokens_per_s / base if base else 0.0
        from ..doctor import machine_info

        return BenchResult(
            workload=workload,
            size=size,
            machine=machine_info(),
            method={
                "rounds": rounds,
                "round_real_tokens": budget,
                "warmup_steps": warmup_steps,
                "val_batches": val_batches,
                "parity_tolerance": max(band, parity_floor),
                "parity_noise_band": band,
                "parity_floor": parity_floor,
                "parity_noise_val_losses": [ref_val, *noise_losses],
                "real_tokens_per_step": target,
                "order": "interleaved A B C per round; medians over rounds",
            },
            peak_flops=peak,
            contenders=results,
            skipped=skipped,
            warnings=warnings,
            wall_s=time.perf_counter() - t_start,
        )
    finally:
        for c in everyone:
            c.close()  # threads and processes a contender started end with the benchmark
