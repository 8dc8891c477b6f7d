"""Side-by-side benchmark of recipes (and peers) on one workload, interleaved round by round.

Method (torch.utils.benchmark / MLPerf style):
- every contender is built once and warmed up (compile happens there; timed as compile_s),
- then rounds run A B C A B C ...: in each round every contender trains until it has consumed the
  same budget of *real* tokens, so drift on a noisy machine hits all of them alike and each sees
  the same amount of learning signal,
- figures are medians over rounds with the interquartile range; IQR/median > 0.1 is flagged.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..decisions import Decision
from ..metrics import dynamo_graph_count
from ..models import loss_of, unwrap
from ..parity import (
    DEFAULT_PARITY_TOLERANCE,
    PARITY_RESOLUTION,
    NullBand,
    default_parity_steps,
    gap_words,
    judge_paired,
    judge_parity,
    min_judged_steps,
    noise_band,
    null_band,
    relative_gap,
    short_run,
    short_run_note,
    unjudged_note,
)
from ..presets import resolve_recipe
from ..recipe import Recipe, RecipeError
from ..runtime import resolve_device
from ..session import Session
from ..shapes.loader import Batch, ShapedLoader
from ..workloads import get_workload
from . import curve_check, precision_band, update_check
from .batching_check import batching_only, check_batching, failure_note, vouch
from .contenders import (
    Contender,
    DocumentWindows,
    LoopContender,
    RoundStats,
    WindowedLoader,
    matched_loader,
    real_tokens_per_step,
)
from .memory import CudaMemory, peak_memory_in_subprocess
from .mfu import model_flops_per_token, peak_flops_from_probe
from .reference_batch import adopt, search_reference_batch
from .twin import adopted_decisions, judge_with_twin, mismatch, twin_recipe

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
    """"pass", "fail", "unjudged" (the run could not see a 1% regression, or a round was cut), or
    "reference"."""
    parity_sampling_error: float | None
    """Paired design: the standard error of the relative gap from which validation batches were
    drawn (batch-clustered; None for the reference, unpaired runs and single-batch validation)."""
    parity_band_kind: str | None
    """Which null band judged it: "numerics" (its batches are the reference's: the reference re-run
    with the rows of each batch permuted), "precision" (the same, re-run in its precision),
    "precision+update" (that band's unjudged turned by the update check), "order" (another order
    inside the windows), "order+check", "check" or "twin+check" (see `_band_kind`), or None."""
    parity_tolerance: float | None
    """The allowed gap its verdict used (None: a band without re-runs, which allows no gap and fails
    none: the batching check or the twin decided)."""
    parity_detectable_effect: float | None
    """The smallest regression its verdict would catch in ~95% of runs (None: unpaired)."""
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
    batching_check: dict[str, Any] | None = None
    """Paired recipe contenders: window 0 through its data path vs the reference's, with the
    reference's final weights (slipstream.bench.batching_check); a gap beyond tolerance fails parity."""
    parity_twin: dict[str, Any] | None = None
    """A recipe that changes batching and numerics together: its twin (the same recipe on the
    reference's shapes and dataflow) judged on the numerics band and curve check (slipstream.bench.twin):
    `name`, `val_loss`, `gap`, `tolerance`, `verdict`, `curve_check`."""
    update_check: dict[str, Any] | None = None
    """Contenders judged on their precision's band: from the reference's final weights and optimizer
    state, their weight change over a step vs the reference's (slipstream.bench.update_check); beyond
    tolerance fails parity, within it vouches for a precision-only recipe its band left unjudged."""
    curve_check: dict[str, Any] | None = None
    """Contenders judged on the numerics band: their mean training loss over the timed steps vs the
    reference's, on the same batches (slipstream.bench.curve_check); a gap beyond the numerics
    re-runs' band fails parity."""


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


@dataclass
class Pairing:
    """What a paired run shares: the document windows and the reference's initial weights."""

    windows: DocumentWindows
    init_state: dict[str, torch.Tensor] | None = None
    """The reference model's weights before its first step (on the host); set by the first load."""
    reference_steps: WindowedLoader | None = None
    """The reference's windowed loader: how many optimizer steps it trains each window in."""
    windows_needed: int = 0
    """Windows the run will train (with a margin): each must hold a contender's steps."""
    _steps: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load_init(self, model: torch.nn.Module) -> str:
        """Give `model` the reference's initial weights (the first model seen becomes the reference);
        a model whose parameters do not match (another max_len, another architecture) keeps its own
        init, and the note says so."""
        if self.init_state is None:
            self.init_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            return "reference"
        own = model.state_dict()
        if own.keys() != self.init_state.keys() or any(
            own[k].shape != v.shape for k, v in self.init_state.items()
        ):
            return "own (parameters differ from the reference's)"
        model.load_state_dict(self.init_state)
        return "reference"

    def adopt_steps(self, reference: WindowedLoader) -> None:
        """The first loader seen is the reference's: every later one trains each window in its steps."""
        if self.reference_steps is None:
            self.reference_steps = reference

    def plan_windows(self, steps: int, margin: int = 2) -> None:
        """Set `windows_needed` for a run of `steps` optimizer steps of the reference."""
        total = w = 0
        while total < steps:
            total += self.steps_per_window(w)
            w += 1
        self.windows_needed = w + margin

    def fits(self, loader: Any) -> bool:
        """Whether a contender's loader cuts every window the run needs into at least the
        reference's steps there (then each step gets at least one of its batches)."""
        return all(
            _batches_in(windowed_loader(loader), w) >= self.steps_per_window(w)
            for w in range(self.windows_needed)
        )

    def steps_per_window(self, w: int) -> int:
        """The reference's optimizer steps in window w, one per batch (asked from the contenders'
        prefetch threads)."""
        with self._lock:
            if w not in self._steps:
                self._steps[w] = _batches_in(self.reference_steps, w)  # type: ignore[arg-type]
            return self._steps[w]


def windowed_loader(loader: Any) -> Any:
    """The WindowedLoader under a contender's loader (inside its prefetch wrapper, where it has one)."""
    return getattr(loader, "loader", loader)


def _batches_in(loader: WindowedLoader, w: int) -> int:
    return len(loader.window_loader(w).plans(epoch=0))


class RecipeContender(LoopContender):
    """A recipe run through Session: the way a slipstream user trains."""

    def __init__(
        self,
        spec: str | Recipe,
        workload: str,
        size: str,
        data,
        val_batches: int,
        reference: Recipe,
        *,
        real_tokens_per_step: float | None = None,
        name: str | None = None,
        pairing: Pairing | None = None,
        order_seed: int = 0,
        row_seed: int = 0,
        searched_batch: Decision | None = None,
        adopted: dict[str, dict[str, str]] | None = None,
    ):
        """`pairing`: the run's shared document windows and the reference's initial weights (None:
        this contender's own init and data order, the seed-band design). `order_seed` permutes the
        documents inside each window (the order null re-runs); `row_seed` permutes the rows inside
        each batch (the numerics null re-runs: the same batches, another reduction order).
        `searched_batch`: the benchmark's tokens-per-batch search on the reference (CUDA), adopted
        instead of searching again (slipstream.bench.reference_batch). `adopted`: decisions its Session
        starts with instead of making (Session's `decisions=`: a numerics twin takes its recipe's,
        slipstream.bench.twin)."""
        self.name = name or spec
        self.recipe: Recipe = resolve_recipe(spec)
        self.spec = spec
        self.session = Session(self.recipe, decisions=adopted)
        adopt(self.session, searched_batch)
        self.precision = self.session.precision
        wl = get_workload(workload)
        model = wl.model(size, self.recipe.shapes.max_len)
        self.init_note = "own"
        if pairing is not None:
            self.init_note = pairing.load_init(model)
        self.model = self.session.prepare_model(model)
        self.optimizer = self.session.build_optimizer(self.model)

        def loader(tokens_per_batch: int | None):
            if pairing is None:
                return self.session.prepare_loader(
                    data.train, tokens_per_batch, lengths=data.train_lengths, pad_id=data.pad_id
                )
            if self.recipe.shapes.mode == "auto" and "shapes.mode" not in self.session.decisions:
                # auto decides on the whole corpus, as without pairing; windows then reuse the choice
                self.session.prepare_loader(
                    data.train, tokens_per_batch, lengths=data.train_lengths, pad_id=data.pad_id
                )

            def window(sequences, lengths):
                return self.session._shaped_loader(
                    sequences, tokens_per_batch, None, pad_id=data.pad_id, lengths=lengths
                )

            steps = None if pairing.reference_steps is None else pairing.steps_per_window
            windowed = WindowedLoader(
                window, data.train, data.train_lengths, pairing.windows, order_seed=order_seed,
                steps_per_window=steps,
            )  # fmt: skip
            return self.session._maybe_prefetch(windowed)

        shapes = self.recipe.shapes
        paired_later = pairing is not None and pairing.reference_steps is not None
        self.loader = matched_loader(
            loader, shapes.tokens_per_batch, real_tokens_per_step, shapes.max_len,
            fits=pairing.fits if paired_later else None,  # type: ignore[union-attr]
        )  # fmt: skip
        if pairing is not None:
            pairing.adopt_steps(windowed_loader(self.loader))
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
        self.row_seed = row_seed
        self._rows = torch.Generator().manual_seed(row_seed)

    def _permute_rows(self, batch: Batch) -> Batch:
        rows = batch["input_ids"].shape[0]
        perm = torch.randperm(rows, generator=self._rows).to(batch["input_ids"].device)
        out = Batch({k: v[perm] if v.dim() and v.shape[0] == rows else v for k, v in batch.items()})
        out.real_tokens, out.padded_tokens, out.shape = batch.real_tokens, batch.padded_tokens, batch.shape
        return out

    def step_inputs(self, batch: Batch) -> Batch:
        """What the model is called with for a loader batch: the one place a contender's data path
        ends (the batching check feeds its batches through it too)."""
        return self._permute_rows(batch) if self.row_seed else batch

    def train_step(self, batch: Batch) -> torch.Tensor:
        weight, step_end = getattr(batch, "weight", 1.0), getattr(batch, "step_end", True)
        batch = self.step_inputs(batch)
        with self.session.autocast():
            loss = loss_of(self.model(**batch))
        self.session.backward(loss if weight == 1.0 else loss * weight)
        if step_end:
            self.session.step(self.optimizer)
        return loss

    def window_batches(self, raw: bool = False) -> list[tuple[Batch, int]]:
        """Window 0's documents as this contender feeds them to its model: (what `step_inputs`
        makes of each of its batches, or the loader's batch itself with `raw`, the batch's predicted
        tokens). Paired runs only."""
        shaped = self.loader.window_loader(0)
        out = []
        for plan in shaped.plans(epoch=0):
            batch = shaped.make_batch(plan)
            out.append((batch if raw else self.step_inputs(batch), int(batch.real_tokens)))
        return out

    @property
    def eager_module(self) -> torch.nn.Module:
        """The model under torch.compile's wrapper: the checks' few steps and forwards run eager, as
        a recompile for them would cost more than they do."""
        return unwrap(self.model)

    def load_state(
        self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
    ) -> torch.nn.Module:
        """Load `model_state` and `optimizer_state` (which stay untouched) into this contender's
        model and optimizer; returns the eager module."""
        module = self.eager_module
        module.load_state_dict(model_state)
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # it would alias same-dtype state
        return module

    def step_updates(
        self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], batches: list[Batch]
    ) -> dict[str, torch.Tensor]:
        """Per parameter: the change of its weights (in fp32) over one optimizer step per batch of
        `batches` (loader batches, fed through `step_inputs`), from `model_state` and
        `optimizer_state` loaded into this contender's model and optimizer, in its precision, with
        its loss scaling and clipping, at the learning rate each group started at (no schedule) and a
        fixed RNG seed. Overwrites its weights and optimizer state: call it after its validation
        (the update check); its step records are left as they were."""
        module = self.load_state(model_state, optimizer_state)
        for group in self.optimizer.param_groups:
            group["lr"] = group.get("initial_lr", group["lr"])  # a decayed schedule could be at ~0
        before = {n: p.detach().float().clone() for n, p in module.named_parameters()}
        session, tracker = self.session, self.session.tracker
        saved = (list(tracker.records), tracker.skipped_steps, session.step_count)
        scheduler = session.schedulers.pop(id(self.optimizer), None)
        was_training = module.training
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)  # dropout draws the same masks on both sides
                module.train()
                for batch in batches:
                    with session.autocast():
                        loss = loss_of(module(**self.step_inputs(batch)))
                    session.backward(loss)
                    session.step(self.optimizer)
        finally:
            module.train(was_training)
            tracker.records[:], tracker.skipped_steps, session.step_count = saved
            if scheduler is not None:
                session.schedulers[id(self.optimizer)] = scheduler
        return {n: p.detach().float() - before[n] for n, p in module.named_parameters()}

    def window_loss(
        self, state: dict[str, torch.Tensor], *batch_lists: list[tuple[Batch, int]]
    ) -> list[float]:
        """Mean loss per predicted token over each of `batch_lists` (as `window_batches` gives them),
        with `state`'s weights loaded once into this contender's model, in its precision, without
        gradients. Overwrites its weights: call it after its validation (the batching check)."""
        module = self.eager_module
        module.load_state_dict(state)
        means = []
        with torch.no_grad():
            for batches in batch_lists:
                sums, tokens = self._loss_sums(module, batches)
                means.append(sum(sums) / max(sum(tokens), 1))
        return means

    def round_mark(self) -> int:
        return len(self.session.tracker.records)

    def data_wait_since(self, mark: int) -> float:
        return sum(r.data_wait_s for r in self.session.tracker.records[mark:])

    def validation_loss(self) -> float:
        sums, tokens = self.validation_sums()
        return float(sum(sums) / max(sum(tokens), 1))

    def validation_sums(self) -> tuple[list[float], list[int]]:
        """Per validation batch: the summed loss over its real tokens, and their count (the same
        batches for every contender; the paired gap's sampling error is computed from these)."""
        plans = self.val_loader.plans(epoch=0)[: self.val_batches]
        batches = ((batch, batch.real_tokens) for batch in map(self.val_loader.make_batch, plans))
        return self._loss_sums(self.model, batches)

    def _loss_sums(self, model: torch.nn.Module, batches) -> tuple[list[float], list[int]]:
        """Per (batch, predicted tokens): the summed loss over those tokens, and their count; the
        model in eval mode and this contender's precision, its training mode restored after."""
        was_training = model.training
        model.eval()
        sums, tokens = [], []
        for batch, real in batches:
            with self.session.autocast():
                loss = loss_of(model(**batch))
            sums.append(loss.double() * real)
            tokens.append(real)
        model.train(was_training)
        return [float(x) for x in torch.stack(sums).tolist()] if sums else [], tokens

    def info(self) -> dict[str, Any]:
        m = self.session.metrics()
        decisions = self.session.decisions
        return {
            "distinct_shapes": m.distinct_shapes,
            "recompiles": m.recompiles,
            "init": self.init_note,
            # windows its shape policy cut into fewer batches than the reference's steps there
            "short_windows": getattr(windowed_loader(self.loader), "short_windows", 0),
            "recipe": self.recipe.to_dict(),
            **({"decisions_list": [{"field": k, **v} for k, v in decisions.items()]} if decisions else {}),
            **{k: v for k, v in m.extra.items() if isinstance(v, (int, float, str, bool))},
        }


def custom_factory(cls: type[RecipeContender]) -> Callable[..., RecipeContender]:
    """The `run_bench(custom=...)` factory for a RecipeContender subclass: the contender named
    `label@recipe-spec` is built from that recipe, matched like the others, and keeps its label."""

    def build(
        spec, workload, size, data, val_batches, reference, target, pairing=None, searched_batch=None
    ) -> RecipeContender:
        return cls(
            spec.split("@", 1)[1], workload, size, data, val_batches, reference,
            real_tokens_per_step=target, name=spec, pairing=pairing, searched_batch=searched_batch,
        )  # fmt: skip

    return build


NOISE_SOURCE = "the reference re-run with other seeds (another init and data order)"
NUMERICS_SOURCE = "the reference re-run with the rows of each batch permuted (same init, same batches)"


def same_batches(a: Recipe, b: Recipe) -> bool:
    """Whether two paired recipes get identical batches: the same shapes section (not `auto`,
    which decides per session). Such a contender differs from the reference only in numerics,
    optimizer or model, and is judged against the numerics null band."""
    return a.shapes == b.shapes and a.shapes.mode != "auto"


DEFAULT_NOISE_SEEDS = 2
"""Order (or, unpaired, seed) re-runs of the reference where some verdict needs them."""

MAX_NUMERICS_SEEDS = 3
"""Numerics re-runs bench trains by default at most: one in the rounds, then more after them, one at a
time, while the band is too wide to judge 1% (fp32 GPT small, seed 3: the first moved the loss 0.47%)."""


def order_band_needed_by(
    reference: Recipe, others: list[Contender], twinned: set[str], peers: list[str]
) -> list[str]:
    """The contenders (and peers) whose verdict only the order band can give. Everyone else is judged
    without it: a same-batch contender on its numerics or precision band; a change of batching alone
    by its batching check; a recipe with a twin by the twin and the check. Over 60 seeded runs of
    planted faults (docs/bench.md) the order band caught none that those missed, and it failed
    harmless bucket once, so its re-runs are trained only where a verdict rests on them."""
    needing = list(peers)
    for c in others:
        recipe = getattr(c, "recipe", None)
        if recipe is not None and same_batches(reference, recipe):
            continue
        if type(c) is RecipeContender and (batching_only(reference, c.recipe) or c.name in twinned):
            continue
        needing.append(c.name)
    return needing


def _validation(c: Contender) -> tuple[float, tuple[list[float], list[int]] | None]:
    """(validation loss, per-batch loss sums and real tokens where the contender gives them)."""
    if isinstance(c, RecipeContender):
        sums, tokens = c.validation_sums()
        return float(sum(sums) / max(sum(tokens), 1)), (sums, tokens)
    return c.validation_loss(), None


def _paired_sampling_error(
    sums: tuple[list[float], list[int]] | None, ref: tuple[list[float], list[int]] | None
) -> float | None:
    """Standard error of the relative paired gap over the validation batches: with d_b the gap's
    per-token contribution of batch b (both runs saw the same batch), SE = sd(d_b) / sqrt(n) / ref
    loss. What drawing other held-out batches would move the verdict by (should be << the band)."""
    if sums is None or ref is None or sums is ref or len(sums[0]) < 2 or sums[1] != ref[1]:
        return None
    tokens = np.asarray(ref[1], dtype=np.float64)
    d = (np.asarray(sums[0]) - np.asarray(ref[0])) / tokens  # per-token gap in each batch
    w = tokens / tokens.sum()
    mean = float((w * d).sum())
    var = float((w * (d - mean) ** 2).sum()) * len(d) / (len(d) - 1)
    ref_loss = float(np.sum(ref[0]) / tokens.sum())
    return math.sqrt(var * float((w**2).sum())) / ref_loss if ref_loss else None


def _twin_row(
    twin: RecipeContender,
    ref_val: float,
    numerics: NullBand | None,
    curve: NullBand | None,
    kind: str,
    curve_means: dict[str, float],
    reference: Contender,
    update_check_of: Callable[[RecipeContender], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The twin's own verdict against the reference: the numerics band (or its precision's band,
    `kind`) on its validation loss, with its update check (`update_check_of`, run after its
    validation: slipstream.bench.update_check) where its precision's band judges it, then the curve
    check on its training loss (slipstream.bench.twin)."""
    val = twin.validation_loss()
    if numerics is None:
        verdict, gap = "unjudged", relative_gap(val, ref_val)
    else:
        verdict, gap = judge_paired(val, ref_val, numerics)
    updates = update_check_of(twin) if update_check_of is not None else None
    if updates is not None:
        only = update_check.precision_only(reference.recipe, twin.recipe)  # type: ignore[attr-defined]
        verdict = "fail" if updates.get("passed") is False else update_check.vouch(verdict, updates, only)
    trajectory = None
    if curve is not None:
        trajectory = curve_check.check_curve(curve_means[twin.name], curve_means[reference.name], curve)
        if not trajectory["passed"]:
            verdict = "fail"
    return {
        "name": twin.name,
        "val_loss": val,
        "gap": gap if math.isfinite(gap) else None,
        "tolerance": numerics.threshold if numerics is not None else None,
        "band": kind,
        "verdict": verdict,
        "curve_check": trajectory,
        "update_check": updates,
    }


def _twin_failure(name: str, row: dict[str, Any]) -> str:
    curve = row.get("curve_check") or {}
    if curve.get("passed") is False:
        why = f"its training loss averages {gap_words(curve['gap'])} off the reference's"
    elif (row.get("update_check") or {}).get("passed") is False:
        u = row["update_check"]
        why = f"its steps change the weights {u['median_error']:.1%} off the reference's (> {u['tolerance']:.1%})"
    elif row["gap"] is None:
        why = "its validation loss is not finite"
    else:
        why = (
            f"its validation loss is {row['gap']:.2%} off (> {row['tolerance']:.2%}, the {row['band']} band)"
        )
    return f"{name}: parity fail: its twin (the same recipe on the reference's batches) fails: {why}"


def _band_kind(same_batch: str | None, vouched: bool, twinned: bool, order_runs: bool) -> str:
    """What decided a paired verdict (`parity_band_kind`): the numerics or precision band
    (`same_batch`); the order band; or the order band's unjudged verdict (or, without `order_runs`,
    no order band at all) turned by the batching check, alone or with the twin; "precision+update":
    the precision band's unjudged verdict turned by the update check."""
    if same_batch:
        return f"{same_batch}+update" if vouched else same_batch
    if vouched:
        return "twin+check" if twinned else "order+check" if order_runs else "check"
    return "order"


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


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
    noise_seeds: int | None = None,
    numerics_seeds: int | None = None,
    precision_seeds: int | None = None,
    grow_numerics: bool | None = None,
    paired: bool = True,
    window_tokens: int | None = None,
    parity_resolution: float = PARITY_RESOLUTION,
    parity_steps: int | None = None,
    match_steps: bool = True,
    min_dtype_speed: float | None = 1 / SLOW_DTYPE_FACTOR,
    max_round_s: float | None = None,
    real_tokens_per_step_target: float | None = None,
    custom: dict[str, Callable[..., Contender]] | None = None,
    tolerate_failures: bool = False,
    twins: bool = True,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark recipes (and peers) side by side; the first contender is the reference.

    With `match_steps` every contender's batches carry the reference's real tokens per optimizer
    step (its token budget per batch is rescaled), so equal real-token budgets mean equal steps and
    the validation losses compare the same training. With `paired` (the default) every recipe
    contender starts from the reference's initial weights and trains on the same document windows
    (`window_tokens` training positions each, default one round's real-token budget); the
    `noise_seeds` extra runs of the reference permute the documents inside each window, and their
    spread is the null band (`slipstream.parity.null_band`; default None: DEFAULT_NOISE_SEEDS where
    some verdict rests on that order band alone, `order_band_needed_by`, else none); a verdict is "unjudged" when the run
    could not catch a `parity_resolution` regression. The reference trains at least `parity_steps`
    optimizer steps (default `default_parity_steps()`: 100, where planted faults show in the loss):
    when `rounds` give fewer, more rounds follow, timed like the first. A pass on fewer steps than
    that (or than 100 with `parity_steps=0`, which adds no rounds) is "unjudged". `paired=False` is the seed-band design: the
    extra runs use other seeds (init and data order) and parity is judged against their spread
    (`noise_band`). `numerics_seeds` more re-runs (default: 1 where some recipe has the reference's
    shapes section, else none) keep the reference's batches and permute the rows inside each one:
    their spread is the numerics band, which judges contenders whose batches are the reference's
    (`same_batches`: only numerics, optimizer or model can differ). A same-batch contender (or twin)
    computing in another precision than the reference is judged instead on that precision's band:
    `precision_seeds` re-runs of the reference in that precision with the rows permuted (default 2
    where one is needed; 0 judges it on the numerics band; slipstream.bench.precision_band). With
    `grow_numerics` (default: when `numerics_seeds` is None) a numerics band too wide to judge 1% gets
    more re-runs after the rounds, up to MAX_NUMERICS_SEEDS. Peers keep their own init and data order: they pass within the band, and are
    "unjudged" (not "fail") outside it unless the gap exceeds the seed-band rule. A recipe that
    forces a dtype the probe measured below `min_dtype_speed` x fp32 is skipped with the figures
    (None runs every dtype). With `twins` (paired, `parity_steps` > 0) a recipe that changes batching
    and numerics together trains beside a twin on the reference's batches, which judges its numerics
    (slipstream.bench.twin; one more run per such recipe, not timed).
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
    if noise_seeds is not None and noise_seeds < 0:
        raise RecipeError(f"noise_seeds={noise_seeds} must be >= 0")
    parity_steps = default_parity_steps() if parity_steps is None else parity_steps
    if parity_steps < 0:
        raise RecipeError(f"parity_steps={parity_steps} must be >= 0 (0: no extra rounds for parity)")
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
    # On CUDA an unpinned reference trains at a searched, GPU-sized batch; everyone adopts it.
    searched = search_reference_batch(specs[0], lambda: wl.model(size, specs[0].shapes.max_len), data, say)
    budget = round_tokens or 2 * (int(searched.choice) if searched else specs[0].shapes.tokens_per_batch)
    pairing = None
    if paired:
        windows = DocumentWindows(
            data.train_lengths, specs[0].shapes.max_len, window_tokens or budget, specs[0].runtime.seed
        )
        pairing = Pairing(windows)

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
                c = custom[spec](
                    spec, workload, size, data, val_batches, specs[0], target, pairing=pairing,
                    searched_batch=searched,
                )  # fmt: skip
            else:
                c = RecipeContender(
                    spec, workload, size, data, val_batches, specs[0], real_tokens_per_step=target,
                    pairing=pairing, searched_batch=searched,
                )  # fmt: skip
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
        if pairing is not None and not pairing.windows_needed and pairing.reference_steps is not None:
            # the windows the reference will train: warm-up, then its rounds or parity_steps
            per_round = max(1.0, budget / max(target or real_tokens_per_step(c.loader), 1.0))
            pairing.plan_windows(warmup_steps + max(parity_steps, math.ceil(rounds * per_round)))
    noise: list[Contender] = []
    base_seed = specs[0].runtime.seed

    def null_run(spec: str | Recipe, name: str, **seeds: Any) -> RecipeContender:
        """A re-run of the reference for a null band: another order (order_seed) or rows (row_seed)."""
        return RecipeContender(
            spec, workload, size, data, val_batches, specs[0],
            real_tokens_per_step=target, name=name, pairing=pairing, searched_batch=searched, **seeds,
        )  # fmt: skip

    twin_of: dict[str, RecipeContender] = {}
    twin_differs: dict[str, list[str]] = {}
    for c in contenders[1:] if paired and twins and parity_steps > 0 else []:
        recipe = twin_recipe(specs[0], c.recipe) if type(c) is RecipeContender else None
        if recipe is None:
            continue
        name = f"{c.name} (twin: the reference's batches)"
        say(f"building {name}")
        try:
            twin = null_run(recipe, name, adopted=adopted_decisions(c.session.decisions))  # type: ignore[arg-type]
        except Exception as err:
            if not tolerate_failures:
                raise
            skipped[name] = _failure("failed to build", err)
            continue
        differs = mismatch(c.session.decisions, twin.session.decisions)
        if differs:  # it would not compute like the recipe: no twin, and the row says why
            twin.close()
            twin_differs[c.name] = differs
            say(f"no twin for {c.name}: it decided otherwise ({'; '.join(differs)})")
            continue
        twin_of[c.name] = twin
    if noise_seeds is None:  # auto: only where some verdict can come from the order band alone
        needing = (
            order_band_needed_by(specs[0], contenders[1:], set(twin_of), peers or []) if paired else ["all"]
        )
        noise_seeds = DEFAULT_NOISE_SEEDS if needing else 0
        if paired and not needing and len(contenders) > 1:
            say("no order re-runs: every contender is judged on its numerics or precision band, "
                "its batching check or its twin (--noise-seeds 2 adds the order band)")  # fmt: skip
    for k in range(1, noise_seeds + 1):
        if paired:  # same init, same windows, another order inside each window
            spec, name = recipes[0], f"{recipes[0]} (null: window order {k})"
        else:
            spec = name = f"{recipes[0]}+runtime.seed={base_seed + k}"
        say(f"building {name} (noise band)")
        noise.append(null_run(spec, name, order_seed=k))
    numerics: list[Contender] = []
    # the precision each same-batch contender and twin computes in: its null is a re-run in it
    judged = [
        c.precision
        for c in [*contenders[1:], *twin_of.values()]
        if isinstance(c, RecipeContender) and same_batches(specs[0], c.recipe)
    ]
    ref_precision = contenders[0].precision
    own_precisions = precision_band.precisions_to_null(ref_precision, judged) if paired else []
    if precision_seeds is None:
        precision_seeds = precision_band.DEFAULT_PRECISION_SEEDS if own_precisions else 0
    if precision_seeds < 0:
        raise RecipeError(f"precision_seeds={precision_seeds} must be >= 0")
    if precision_seeds == 0:
        own_precisions = []
    numerics_auto = numerics_seeds is None if grow_numerics is None else grow_numerics
    if numerics_seeds is None:  # auto: 1, where a contender shares the reference's batches (its
        # spread is ~1e-7 in fp32, so even t(0.995, 1 df) leaves the floor in charge; one run keeps the
        # cost). Where it moved the loss more than that, more follow after the rounds (MAX_NUMERICS_SEEDS).
        numerics_seeds = 1 if any(p not in own_precisions for p in judged) else 0

    def numerics_run(k: int) -> RecipeContender:
        """The k-th numerics re-run: the reference on its batches with the rows permuted."""
        name = f"{recipes[0]} (null: row order {k})"
        say(f"building {name} (numerics band)")
        return null_run(recipes[0], name, row_seed=k)

    if paired:
        numerics.extend(numerics_run(k) for k in range(1, numerics_seeds + 1))
    precision_nulls: dict[str, list[RecipeContender]] = {}
    for p in own_precisions:
        for k in range(1, precision_seeds + 1):
            name = f"{recipes[0]} (null: {p}, row order {k})"
            say(f"building {name} (precision band)")
            recipe = precision_band.null_recipe(specs[0], p)
            precision_nulls.setdefault(p, []).append(null_run(recipe, name, row_seed=k))
    for peer in peers or []:
        try:
            say(f"building peer {peer}")
            contenders.append(PEERS[peer](workload, size, data, specs[0], val_batches, target))
        except PeerUnavailable as why:
            skipped[peer] = str(why)

    everyone = [
        *contenders, *noise, *numerics, *(c for runs in precision_nulls.values() for c in runs),
        *twin_of.values(),
    ]  # fmt: skip
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

        def warm_up(c: Contender) -> bool:
            """The untimed first steps; False where the contender failed in them."""
            say(f"warm-up {c.name}")
            t0 = time.perf_counter()
            since = cuda_memory.allocated()
            recompiles.setdefault(c.name, 0)
            first = counted_round(c, None, 1)
            recompiles[c.name] = 0  # the first step's graphs are compiles, not recompiles
            rest = (
                counted_round(c, None, warmup_steps - 1) if first is not None and warmup_steps > 1 else first
            )
            warm[c.name] = time.perf_counter() - t0
            cuda_memory.keep(c.name, since)  # optimizer state, CUDA graph pools: created by the first steps
            return rest is not None

        for c in everyone:
            warm_up(c)

        per_round: dict[str, list[RoundStats]] = {c.name: [] for c in everyone}
        planned, ref_trained, rounds_run = rounds, 0, 0
        ref_round_steps: list[int] = []  # the reference's steps per round: what a later null replays
        # more rounds until the reference has trained parity_steps steps (PARITY_MIN_STEPS: a
        # planted fault shows in the loss by then); they are timed like the first ones
        while rounds_run < rounds or ref_trained < parity_steps:
            ref_steps: int | None = None
            planned = max(planned, rounds_run + 1)  # rounds of fewer steps than the first add one
            for c in everyone:  # interleaved: A B C A B C ...
                if c.name in failed:
                    continue
                # Paired: every recipe trains exactly the reference's steps of this round (its real
                # tokens differ by the matching tolerance at most); at this budget val loss moves
                # several percent per step, so a step more or less would swamp any verdict.
                steps_only = paired and ref_steps is not None and isinstance(c, RecipeContender)
                with cuda_memory.round(c.name):
                    st = counted_round(c, None, ref_steps) if steps_only else counted_round(c, budget)
                if ref_steps is None and st is not None and c is contenders[0]:
                    ref_steps = st.steps
                    ref_trained += st.steps
                    ref_round_steps.append(st.steps)
                if st is None:
                    continue
                per_round[c.name].append(st)
                say(
                    f"round {rounds_run + 1}/{planned} {c.name}: {st.real_tokens / st.seconds:,.0f} real tok/s "
                    f"({st.steps} steps, {st.seconds:.1f} s)"
                )
            rounds_run += 1
            if not ref_steps:  # a reference round without a step would never reach parity_steps
                break
            if rounds_run == 1 and parity_steps > ref_steps * rounds:
                planned = -(-parity_steps // ref_steps)
                say(
                    f"parity needs {parity_steps} optimizer steps: {planned} rounds of {ref_steps} "
                    f"instead of {rounds} (--parity-steps 0 times {rounds} rounds only)"
                )

        say("reading the peak matmul rate (machine probe)")
        peak = peak_flops_from_probe(device)
        noise_sums = []
        contenders = [c for c in contenders if c.name not in failed]
        for c in noise:
            if c.name in failed:
                continue
            say(f"validation {c.name}")
            noise_sums.append(_validation(c))
        noise_losses = [v for v, _ in noise_sums]
        numerics_losses = []
        for c in numerics:
            if c.name not in failed:
                say(f"validation {c.name}")
                numerics_losses.append(c.validation_loss())

        def replay(c: RecipeContender) -> list[RoundStats] | None:
            """Train a null built after the rounds as the rounds trained it: its warm-up, then the
            reference's steps of each round (untimed: a null, not a contender)."""
            if not warm_up(c):
                return None
            stats = [counted_round(c, None, n) for n in ref_round_steps]
            return None if any(st is None for st in stats) else stats  # type: ignore[return-value]

        ref_validation: tuple[float, tuple[list[float], list[int]] | None] | None = None
        if numerics_auto and numerics_losses and paired and ref_trained >= min_judged_steps(parity_steps):
            # the one fp32 re-run assumed a spread of ~1e-7; where it moved the loss by itself (a
            # model whose training amplifies reassociation), t(0.995, 1) = 63.7 would leave every
            # same-batch verdict unjudged: more re-runs, after the rounds, narrow t (9.9 at 2, 5.8 at
            # 3). Not on a run too short for a pass: its verdicts are unjudged whatever the band.
            ref_validation = _validation(contenders[0])
            while (
                len(numerics) < MAX_NUMERICS_SEEDS
                and not null_band(
                    ref_validation[0], numerics_losses, parity_floor, resolution=parity_resolution
                ).judged
            ):
                say("the numerics re-run moved the loss by itself: one more, trained after the rounds")
                extra = numerics_run(len(numerics) + 1)
                everyone.append(extra)
                numerics.append(extra)
                stats = replay(extra)
                if stats is None:
                    break
                per_round[extra.name] = stats
                numerics_losses.append(extra.validation_loss())
        precision_losses = {
            p: [n.validation_loss() for n in runs if n.name not in failed]
            for p, runs in precision_nulls.items()
        }
        numerics_null: NullBand | None = None
        curve_null: NullBand | None = None
        own_bands: dict[str, tuple[NullBand, NullBand]] = {}
        """precision -> its precision band and curve band (slipstream.bench.precision_band)."""

        def bands_for(precision: str) -> tuple[NullBand | None, NullBand | None, str | None]:
            """The bands that judge a same-batch contender (or twin) computing in `precision`, and
            their kind: "precision" (its own re-runs), "numerics" (the reference's), or None where
            no same-batch band was measured (the order band judges it)."""
            if precision in own_bands:
                return (*own_bands[precision], "precision")
            return numerics_null, curve_null, "numerics" if numerics_null is not None else None

        curve_means = {
            c.name: curve_check.mean_train_loss([x for st in per_round[c.name] for x in st.losses])
            for c in everyone
            if c.name not in failed
        }
        min_steps = min_judged_steps(parity_steps)
        too_short: list[str] = []
        ref_model = getattr(contenders[0], "model", None)
        ref_state = unwrap(ref_model).state_dict() if ref_model is not None else {}
        ref_batches: list[tuple[Batch, int]] = []
        reference_step = functools.cache(lambda: update_check.ReferenceStep.take(contenders[0]))

        def update_row(c: RecipeContender) -> dict[str, Any]:
            """The update check's row for `c` (the reference's step is taken once, when first needed)."""
            say(f"update check {c.name}")
            return reference_step().check(c)

        results: list[ContenderResult] = []
        warnings: list[str] = []
        ref_val: float | None = None
        ref_sums: tuple[list[float], list[int]] | None = None
        band = 0.0
        null: NullBand | None = None
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
            val, sums = ref_validation if ref_validation and c is contenders[0] else _validation(c)
            check: dict[str, Any] | None = None
            if paired and isinstance(c, RecipeContender) and c is not contenders[0]:
                say(f"batching check {c.name}")
                ref_batches = ref_batches or contenders[0].window_batches()  # once, when needed
                check = check_batching(c, ref_state, ref_batches)
            if ref_val is None:
                ref_val, ref_sums = val, sums
                band = noise_band([val, *noise_losses])
                if paired:
                    null = null_band(val, noise_losses, parity_floor, resolution=parity_resolution)
                    band = null.spread
                    if numerics:
                        numerics_null = null_band(
                            val, numerics_losses, parity_floor, resolution=parity_resolution,
                            source=NUMERICS_SOURCE,
                        )  # fmt: skip
                        curve_null = null_band(
                            curve_means[c.name], [curve_means[n.name] for n in numerics if n.name in curve_means],
                            parity_floor, resolution=parity_resolution, source=curve_check.CURVE_SOURCE,
                        )  # fmt: skip
                    for p, runs in precision_nulls.items():
                        source = precision_band.precision_source(p)
                        own_bands[p] = (
                            null_band(val, precision_losses[p], parity_floor, resolution=parity_resolution,
                                      source=source),
                            null_band(curve_means[c.name], [curve_means[n.name] for n in runs if n.name in curve_means],
                                      parity_floor, resolution=parity_resolution,
                                      source=curve_check.curve_source(source)),
                        )  # fmt: skip
            sampling_error = _paired_sampling_error(sums, ref_sums) if paired else None
            used: NullBand | None = null
            numerics_band: NullBand | None = None
            curve_band: NullBand | None = None
            same_batch_kind: str | None = None
            updates: dict[str, Any] | None = None
            if isinstance(c, RecipeContender) and c is not contenders[0]:
                if same_batches(contenders[0].recipe, c.recipe):
                    # the same batches as the reference: only numerics can differ
                    numerics_band, curve_band, same_batch_kind = bands_for(c.precision)
                    used = numerics_band or null
                    if same_batch_kind == "precision":
                        updates = update_row(c)
            vouched = False
            twin_row: dict[str, Any] | None = None
            if used is not None:
                verdict, gap = judge_paired(val, ref_val, used)
                if verdict == "fail" and c.kind == "peer":
                    # a peer has its own init and data order: only the seed-band rule can fail it
                    seed_rule, _, _ = judge_parity(val, ref_val, DEFAULT_PARITY_TOLERANCE, parity_floor)
                    verdict = seed_rule if seed_rule == "fail" else "unjudged"
                if used is null and type(c) is RecipeContender and c is not contenders[0]:
                    only = batching_only(contenders[0].recipe, c.recipe)  # type: ignore[attr-defined]
                    vouched_verdict = vouch(verdict, check, only)
                    vouched, verdict = vouched_verdict != verdict, vouched_verdict
                if updates is not None:
                    only = type(c) is RecipeContender and update_check.precision_only(
                        contenders[0].recipe,  # type: ignore[attr-defined]
                        c.recipe,  # type: ignore[attr-defined]
                    )
                    vouched_verdict = update_check.vouch(verdict, updates, only)
                    vouched, verdict = vouched_verdict != verdict, vouched_verdict
                twin = twin_of.get(c.name)
                if used is null and twin is not None and twin.name not in failed:
                    say(f"validation {twin.name}")
                    twin_bands = bands_for(twin.precision)
                    twin_row = _twin_row(
                        twin, ref_val, *twin_bands, curve_means, contenders[0],
                        update_row if twin_bands[2] == "precision" else None,
                    )  # fmt: skip
                    twinned = judge_with_twin(verdict, check, twin_row)
                    if twinned != verdict and twin_row["verdict"] == "fail":
                        warnings.append(_twin_failure(c.name, twin_row))
                    vouched, verdict = vouched or twinned != verdict, twinned
                if c.name in twin_differs and verdict == "unjudged":
                    warnings.append(
                        f"{c.name}: no numerics twin: one built on the reference's batches decided "
                        f"{'; '.join(twin_differs[c.name])} (the recipe's vs its own), so it would not "
                        "compute like the recipe; its parity rests on the order band"
                    )
                if verdict == "unjudged" and c is not contenders[0]:
                    if c.kind == "peer":
                        warnings.append(f"{c.name}: parity unjudged: not paired (own init and data order)")
                    elif same_batch_kind == "precision":
                        warnings.append(precision_band.unjudged_note(c.name, c.precision, used))
                    elif same_batch_kind == "numerics":
                        warnings.append(unjudged_note(c.name, used, "--numerics-seeds"))
                    else:
                        warnings.append(unjudged_note(c.name, used))
            else:
                verdict, gap, _ = judge_parity(val, ref_val, band, parity_floor)
            if check is not None and check.get("passed") is False:
                verdict = "fail"
                warnings.append(failure_note(c.name, check))
            if updates is not None and updates.get("passed") is False:
                verdict = "fail"
                warnings.append(update_check.failure_note(c.name, c.precision, updates))
            trajectory: dict[str, Any] | None = None
            if same_batch_kind and curve_band is not None:
                trajectory = curve_check.check_curve(
                    curve_means[c.name], curve_means[contenders[0].name], curve_band
                )
                if not trajectory["passed"]:
                    verdict = "fail"
                    warnings.append(curve_check.failure_note(c.name, trajectory))
            if c is not contenders[0] and short_run(verdict, ref_trained, min_steps) != verdict:
                verdict = "unjudged"
                too_short.append(c.name)
            info = c.info()
            short = info.get("short_windows", 0)
            if short and verdict == "pass":  # its steps drifted from the reference's windows
                verdict = "unjudged"
                warnings.append(
                    f"{c.name}: parity unjudged: {short} window(s) held fewer of its batches than the "
                    "reference's steps, so its steps no longer met the reference's documents"
                )
            if c is contenders[0]:
                verdict = "reference"
            elif c.name in capped:
                verdict = "unjudged"
                warnings.append(
                    f"{c.name}: rounds cut at {max_round_s:.0f} s before the token budget; parity not judged"
                )
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
                    parity_sampling_error=sampling_error,
                    parity_band_kind=None
                    if used is None or c is contenders[0]
                    else _band_kind(
                        same_batch_kind,
                        vouched,
                        twin_row is not None,
                        bool(noise),
                    ),
                    parity_tolerance=used.allowed if used is not None else max(band, parity_floor),
                    parity_detectable_effect=_finite_or_none(used.detectable) if used is not None else None,
                    mfu=mfu,
                    precision=c.precision,
                    noisy=noisy,
                    loss_curve=curve,
                    time_breakdown_s={"compute": max(0.0, seconds - data_wait), "data_wait": data_wait},
                    info={k: v for k, v in info.items() if k not in ("distinct_shapes", "recompiles")},
                    batching_check=check,
                    update_check=updates,
                    curve_check=trajectory,
                    parity_twin=twin_row,
                )
            )
        if too_short:
            warnings.append(short_run_note(", ".join(too_short), ref_trained, min_steps))
        base = results[0].real_tokens_per_s
        for res in results:
            res.speedup = res.real_tokens_per_s / base if base else 0.0
        from ..doctor import machine_info

        return BenchResult(
            workload=workload,
            size=size,
            machine=machine_info(),
            method={
                "rounds": rounds_run,
                "rounds_asked": rounds,
                "parity_steps": parity_steps,
                "parity_min_steps": min_steps,
                "parity_steps_trained": ref_trained,
                "round_real_tokens": budget,
                "warmup_steps": warmup_steps,
                "val_batches": val_batches,
                "parity_design": "paired" if paired else "seeds",
                "parity_tolerance": null.threshold if null else max(band, parity_floor),
                "parity_noise_band": band,
                "parity_band_source": null.source if null else NOISE_SOURCE,
                "parity_detectable_effect": _finite_or_none(null.detectable) if null else None,
                "parity_null_sigma": _finite_or_none(null.sigma) if null else None,
                "parity_resolution": parity_resolution if paired else None,
                "parity_floor": parity_floor,
                "parity_noise_val_losses": [ref_val, *noise_losses],
                "parity_window_tokens": pairing.windows.window_tokens if pairing else None,
                "val_real_tokens": sum(ref_sums[1]) if ref_sums else None,
                "parity_numerics_band": numerics_null.to_dict() if numerics_null else None,
                "parity_curve_band": curve_null.to_dict() if curve_null else None,
                "parity_precision_bands": {
                    p: {"validation": v.to_dict(), "curve": cu.to_dict()} for p, (v, cu) in own_bands.items()
                },
                "real_tokens_per_step": target,
                "batch_search": searched.to_dict() if searched else None,
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
