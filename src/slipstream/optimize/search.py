"""`slipstream optimize`: a staged, measured search for the fastest recipe that still learns the same.

Stages run in order (shapes first: it moves the most, and the others are judged on top of it). In
each stage the current best and the stage's candidates are trained side by side by `run_bench`
(interleaved rounds, warm-up excluded, each contender matched to the reference's real tokens per
optimizer step, so equal real-token budgets are equal training). A candidate becomes the new best
only when

- its median real tokens/s beats the current best's by more than the noise measured in that stage
  (the larger relative IQR of the two, never below MIN_GAIN), and
- its parity verdict is "pass": `slipstream bench`'s paired guard (same initial weights, same
  document windows), its validation loss within the null band of stage 0 (the reference re-run
  with another order of the same documents inside each window) *and* the run able to catch a 1%
  regression. A candidate whose verdict is "unjudged" (the band too wide to see 1%) is never kept.

Every candidate's speed, parity and verdict is kept for the report. A stage that would not fit in
the remaining time budget is skipped and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import decisions, machine
from ..bench import curve_check, update_check
from ..bench.batching_check import batching_only, vouch
from ..bench.runner import run_bench, same_batches
from ..parity import (
    PARITY_RESOLUTION,
    NullBand,
    default_parity_steps,
    gap_words,
    judge_paired,
    min_judged_steps,
    null_band,
    short_run,
    short_run_reason,
)
from ..presets import resolve_recipe
from ..recipe import Recipe, RecipeError
from ..runtime import resolve_device

MIN_GAIN = 0.02
"""A change must be at least 2% faster to be kept, even when a stage's rounds agree more closely:
below that a re-run on a shared 2-core machine flips the order."""

BUCKETS_RANGE = (2, 32)
"""shapes.buckets searched by the tune module's Fibonacci sampler (Optuna) when bucket won shapes:
few buckets pad more, many buckets mean more distinct shapes (compiles, smaller batches)."""

BUCKET_TRIALS = 4
"""Fibonacci evaluations of the bucket count (each a side-by-side run against the current best)."""

TRY_DTYPE_RATIO = 0.8
"""The precision stage measures a cheaper dtype end to end when its matmuls reached at least this
fraction of fp32's in the probe (a near-tie can still win on memory traffic); below it, the probe's
figures are the reason it is not tried."""


@dataclass(frozen=True)
class Stage:
    name: str
    """What the stage decides, e.g. "shapes"."""
    options: tuple[tuple[str, ...], ...]
    """Each option is a list of `section.field=value` overrides applied on top of the current best."""


STAGES: dict[str, Stage] = {
    "shapes": Stage(
        "shapes",
        (
            ("shapes.mode=pad_batch",),
            ("shapes.mode=bucket",),
            ("shapes.mode=pack",),
        ),
    ),
    "buckets": Stage("buckets", (("shapes.buckets=4",), ("shapes.buckets=16",))),
    # ^ with Optuna installed, refined by Fibonacci search over BUCKETS_RANGE instead (_refine_buckets)
    "precision": Stage(
        "precision", (("precision.dtype=bf16",), ("precision.dtype=fp16",), ("precision.tf32=on",))
    ),
    "kernels": Stage("kernels", (("kernels.ops=auto",),)),
    "compile": Stage("compile", (("compile.mode=default",),)),
    "optimizer": Stage("optimizer", (("optimizer.impl=fused",), ("optimizer.impl=for-loop",))),
    "prefetch": Stage("prefetch", (("dataflow.prefetch=true",),)),
}
DEFAULT_STAGES = ("shapes", "buckets", "precision", "kernels", "compile", "optimizer", "prefetch")


@dataclass
class Candidate:
    stage: str
    spec: str
    overrides: list[str]
    real_tokens_per_s: float | None = None
    speed_vs_best: float | None = None
    """Median real tokens/s over the stage's current best (same stage, interleaved)."""
    noise: float | None = None
    """The stage's relative noise the gain had to beat."""
    val_loss: float | None = None
    parity_gap: float | None = None
    parity: str | None = None
    """pass / fail / unjudged (the paired guard's verdict)."""
    parity_band: float | None = None
    """The allowed gap the verdict used (stage 0's null band threshold)."""
    parity_against: str | None = None
    """None: `parity_gap` is measured from the reference. A spec: a change of numerics on top of a
    kept change of batching, measured on the numerics band from the recipe kept with those batches
    (`_Anchor`)."""
    parity_detectable_effect: float | None = None
    """The smallest regression that verdict would have caught (~95%); above 1%: "unjudged"."""
    peak_memory_bytes: int | None = None
    verdict: str = ""
    """kept / rejected / skipped, with why."""


@dataclass
class OptimizeResult:
    workload: str
    size: str
    base: str
    best_spec: str
    best_overrides: list[str]
    best_recipe: dict[str, Any]
    reference_real_tokens_per_s: float
    best_real_tokens_per_s: float
    """The winner's median real tokens/s in the last stage it was measured in."""
    speedup_estimate: float
    """Product of the kept per-stage gains (each measured side by side within its stage)."""
    parity_band: float
    """The allowed |val loss gap| (the null band's threshold, stage 0)."""
    parity_detectable_effect: float | None
    """Smallest regression the guard would catch in ~95% of runs (None: no null re-runs)."""
    parity_band_source: str
    reference_val_losses: list[float]
    candidates: list[Candidate]
    stages: dict[str, str]
    """stage -> what happened (kept X, nothing beat the best, skipped: why)."""
    budget_s: float
    wall_s: float
    machine: dict[str, Any]
    bench_command: str
    method: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Anchor:
    """What a candidate with these batches is judged against on the numerics band: the reference,
    until a change of batching is kept; then the recipe kept with it (its batches, the reference's
    numerics, judged when kept). Against the reference such a candidate's batches differ and only
    the order band could judge it, which at 100 steps seldom resolves 1% (docs/bench.md). Each stage
    measures the candidate paired with the stage's best in one run; `offset` carries the best's own
    distance from the anchor (the kept numerics gaps, summed), so small gaps cannot add up unseen
    over several numerics stages."""

    spec: str
    recipe: Recipe
    val_loss: float
    offset: float = 0.0
    """The current best's val loss minus the anchor's, summed over the stages since it was kept."""

    def seen_from(self, val_loss: float, best_val_loss: float) -> float:
        """A candidate's val loss as if measured in the anchor's run: its paired difference from the
        stage's best (same run, same batches) on top of the best's offset."""
        return self.val_loss + self.offset + (val_loss - best_val_loss)


def _curve_row(c: Any, best: Any, band: Any) -> dict[str, Any] | None:
    """bench's curve check of candidate `c` against the stage's `best` (same run, same batches):
    None where the stage results carry no loss curves or stage 0 measured no curve band."""
    curves = [getattr(x, "loss_curve", None) for x in (c, best)]
    if band is None or not all(curves):
        return None
    means = [curve_check.mean_train_loss([loss for _, loss in xs]) for xs in curves]  # type: ignore[union-attr]
    return curve_check.check_curve(means[0], means[1], band)


def _spec(base: str, overrides: list[str]) -> str:
    return "+".join([base, *overrides])


def _merge(current: list[str], new: tuple[str, ...]) -> list[str]:
    """Overrides of `current` with `new` applied (a field set again replaces its old value)."""
    keys = {o.split("=", 1)[0] for o in new}
    return [o for o in current if o.split("=", 1)[0] not in keys] + list(new)


def _stage_options(stage: Stage, best: Recipe, device) -> tuple[list[tuple[str, ...]], list[str]]:
    """The options worth measuring now, and notes on those left out (with the reason)."""
    notes, keep = [], []
    for opt in stage.options:
        value = opt[0].split("=", 1)[1]
        if stage.name == "buckets" and best.shapes.mode != "bucket":
            notes.append(f"{opt[0]}: not tried (shapes.mode is {best.shapes.mode})")
            continue
        if stage.name == "precision":
            # tf32=on is priced by the probe's tf32 row (CUDA only), a dtype by its own row
            dtype = "tf32" if opt[0].startswith("precision.tf32") else value
            why = decisions.too_slow(machine.probe(device), dtype, TRY_DTYPE_RATIO)
            if why:
                notes.append(f"{opt[0]}: not tried ({why})")
                continue
        if stage.name == "compile":
            check = machine.probe(device, checks=("compile",)).checks["compile"]
            if not check.ok:
                notes.append(f"{opt[0]}: not tried (torch.compile does not work here: {check.detail})")
                continue
        keep.append(opt)
    return keep, notes


def _has_optuna() -> bool:
    import importlib.util

    return importlib.util.find_spec("optuna") is not None


def _refine_buckets(measure, best: Recipe, left_s: float, trial_s: float, say) -> list[tuple[str, ...]]:
    """Fibonacci search (tune.fibonacci on Optuna) of shapes.buckets around the current best: each
    trial measures one bucket count side by side with the current best and scores the ratio. The
    best count found is returned as the stage's candidate, to be measured and judged like any other."""
    import optuna

    from ..tune.fibonacci import FibonacciSampler

    trials = max(0, min(BUCKET_TRIALS, int(left_s // max(trial_s, 1e-9)) - 2))
    current = best.shapes.buckets
    if trials < 2:
        return [("shapes.buckets=4",), ("shapes.buckets=16",)]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=FibonacciSampler(trials, seed=0))
    seen: dict[int, float] = {}

    def objective(trial) -> float:
        k = trial.suggest_int("buckets", *BUCKETS_RANGE)
        if k == current:
            return 1.0
        if k not in seen:
            res = measure([(f"shapes.buckets={k}",)])
            cs = res.contenders
            seen[k] = cs[1].real_tokens_per_s / cs[0].real_tokens_per_s if len(cs) > 1 else 0.0
            say(f"  buckets={k}: {seen[k]:.3f}x buckets={current}")
        return seen[k]

    study.optimize(objective, n_trials=trials)
    k = int(study.best_params["buckets"])
    if k == current:
        k = max(seen, key=seen.get) if seen else BUCKETS_RANGE[0]
    return [(f"shapes.buckets={k}",)]


def optimize(
    workload: str = "gpt-stdlib",
    *,
    base: str = "baseline",
    size: str = "tiny",
    budget_s: float = 300.0,
    stages: tuple[str, ...] = DEFAULT_STAGES,
    rounds: int = 3,
    round_tokens: int | None = None,
    noise_seeds: int = 2,
    parity_floor: float = 0.002,
    parity_resolution: float = PARITY_RESOLUTION,
    parity_steps: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> OptimizeResult:
    """Search recipes by measurement within `budget_s` seconds; see the module docstring."""
    say = progress or (lambda msg: None)
    for name in stages:
        if name not in STAGES:
            raise RecipeError(f"unknown optimize stage {name!r}; choose from {', '.join(STAGES)}")
    if budget_s <= 0:
        raise RecipeError(f"--budget must be positive, got {budget_s:g} s")
    reference = resolve_recipe(base)
    device = resolve_device(reference.runtime.device)
    t0 = time.perf_counter()
    parity_steps = default_parity_steps() if parity_steps is None else parity_steps
    min_steps = min_judged_steps(parity_steps)
    common = dict(
        size=size, rounds=rounds, round_tokens=round_tokens, memory="skip", min_dtype_speed=None,
        parity_steps=parity_steps, progress=say,
    )  # fmt: skip
    # the stages judge on stage 0's bands: no numerics re-run of their own, and every candidate is one
    # change on the best (never batching and numerics together), so no twin. A candidate computing in
    # another precision than the best brings that precision's re-runs (run_bench's precision_seeds)
    stage_only = dict(noise_seeds=0, numerics_seeds=0, twins=False)

    say(f"stage reference: {base} and {noise_seeds} null re-runs (another order inside each window)")
    ref = run_bench(
        workload,
        [base],
        noise_seeds=noise_seeds,
        numerics_seeds=1,
        grow_numerics=True,  # as bench's default: more where the first re-run moved the loss
        parity_floor=parity_floor,
        **common,
    )
    target = ref.method["real_tokens_per_step"]
    searched = ref.method.get("batch_search")
    if searched:  # CUDA: every later stage trains at the size the reference stage searched, once
        base = f"{base}+shapes.tokens_per_batch={searched['choice']}+shapes.batch_search=off"
        say(f"reference tokens per batch: {searched['choice']} (searched; pinned for every stage)")
        reference = resolve_recipe(base)  # the batches it trained: candidates with them share them
    ref_val = ref.contenders[0].val_loss
    vals = ref.method["parity_noise_val_losses"]
    band = null_band(vals[0], vals[1:], parity_floor, resolution=parity_resolution)

    def band_from(entry: dict | None) -> NullBand | None:
        """A band a run measured (a `method` entry: its values and source), judged with our floor."""
        if not entry:
            return None
        v = entry["val_losses"]
        return null_band(v[0], v[1:], parity_floor, resolution=parity_resolution, source=entry["source"])

    # for candidates with the base's batches (same shapes section): only numerics differ
    numerics_band = band_from(ref.method.get("parity_numerics_band")) or band
    curve_band = band_from(ref.method.get("parity_curve_band"))  # the numerics re-run's mean training loss
    detectable = band.detectable if band.detectable != float("inf") else None
    per_contender_s = ref.wall_s / (1 + noise_seeds)
    say(
        f"reference: {ref.contenders[0].real_tokens_per_s:,.0f} real tok/s; parity band {band.threshold:.2%}, "
        f"would catch >= {band.detectable:.2%}"
        + (
            ""
            if band.judged
            else " (too wide to judge a change of batching by its loss: its batching check vouches for it)"
        )
    )

    best: list[str] = []
    own_bands: dict[str, tuple[NullBand | None, NullBand | None]] = {}
    """precision -> its band and curve band (`method.parity_precision_bands`), from the first stage
    that ran it."""
    anchor = _Anchor(base, reference, ref_val)
    best_tps = ref.contenders[0].real_tokens_per_s
    speedup = 1.0
    candidates: list[Candidate] = []
    outcome: dict[str, str] = {}
    for name in stages:
        stage = STAGES[name]
        best_recipe = resolve_recipe(_spec(base, best))
        options, notes = _stage_options(stage, best_recipe, device)
        for note in notes:
            opt = note.split(":", 1)[0]
            candidates.append(Candidate(name, _spec(base, _merge(best, (opt,))), [opt], verdict=note))
        if not options:
            outcome[name] = "nothing to try: " + "; ".join(notes)
            continue
        # compile stages pay a first compile per contender; estimated from the probe's compile check
        extra = 0.0
        if name == "compile":
            extra = machine.probe(device, checks=("compile",)).checks["compile"].seconds
        estimate = (len(options) + 1) * per_contender_s + len(options) * extra
        left = budget_s - (time.perf_counter() - t0)
        if estimate > left:
            outcome[name] = f"skipped: needs ~{estimate:.0f} s, {max(left, 0):.0f} s of the budget left"
            for opt in options:
                candidates.append(
                    Candidate(name, _spec(base, _merge(best, opt)), list(opt), verdict=outcome[name])
                )
            say(f"stage {name}: {outcome[name]}")
            continue
        if name == "buckets" and _has_optuna():
            options = _refine_buckets(
                lambda opts, best=best: run_bench(
                    workload, [_spec(base, best)] + [_spec(base, _merge(best, o)) for o in opts],
                    tolerate_failures=True, parity_floor=parity_floor,
                    real_tokens_per_step_target=target, **stage_only, **common,
                ),
                best_recipe,
                left,
                2 * per_contender_s,
                say,
            )  # fmt: skip
        specs = [_spec(base, best)] + [_spec(base, _merge(best, opt)) for opt in options]
        say(f"stage {name}: {len(options)} candidate(s) against {specs[0]}")
        res = run_bench(
            workload,
            specs,
            tolerate_failures=True,
            parity_floor=parity_floor,
            real_tokens_per_step_target=target,
            **stage_only,
            **common,
        )
        by_name = {c.name: c for c in res.contenders}
        # a candidate computing in another precision than the reference: judged on that precision's
        # band, measured by the stage that first tried it (re-runs of the best in it,
        # slipstream.bench.precision_band) and kept for every later stage in it
        for p, entry in (res.method.get("parity_precision_bands") or {}).items():
            if p not in own_bands:
                own_bands[p] = (band_from(entry["validation"]), band_from(entry["curve"]))
        cur = by_name[specs[0]]
        cur_noise = cur.real_tokens_per_s_iqr / cur.real_tokens_per_s if cur.real_tokens_per_s else 1.0
        winner: tuple[float, list[str], Any] | None = None
        for opt, spec in zip(options, specs[1:]):
            cand = Candidate(name, spec, list(opt))
            c = by_name.get(spec)
            if c is None:
                cand.verdict = f"rejected: {res.skipped.get(spec, 'did not run')}"
                candidates.append(cand)
                continue
            ratio = c.real_tokens_per_s / cur.real_tokens_per_s
            noise = max(cur_noise, c.real_tokens_per_s_iqr / c.real_tokens_per_s, MIN_GAIN)
            recipe = resolve_recipe(spec)
            precision = getattr(c, "precision", None)
            own = (
                own_bands.get(precision)
                if precision != getattr(ref.contenders[0], "precision", None)
                else None
            )
            same_batch_band, same_batch_curve = own or (numerics_band, curve_band)
            band_name = "precision" if own else "numerics"
            used = same_batch_band if same_batches(reference, recipe) else band
            verdict, gap = judge_paired(c.val_loss, ref_val, used)
            against: str | None = None
            check = getattr(c, "batching_check", None) or {}
            if used is band and verdict != "fail" and anchor.recipe is not reference:
                if same_batches(anchor.recipe, recipe):  # numerics on a kept change of batching
                    used, against = same_batch_band, anchor.spec
                    verdict, gap = judge_paired(
                        anchor.seen_from(c.val_loss, cur.val_loss), anchor.val_loss, used
                    )
            if used is band:  # batched differently: a change of batching alone is vouched by the check
                # (against the stage's best, which was judged when it was kept)
                verdict = vouch(verdict, check, batching_only(best_recipe, recipe))
            updates = getattr(c, "update_check", None) or {}
            if own and used is same_batch_band:  # its precision's band: the update check vouches or fails
                verdict = update_check.vouch(
                    verdict, updates, update_check.precision_only(best_recipe, recipe)
                )
            verdict = short_run(verdict, cur.steps, min_steps)
            if check.get("passed") is False:  # its data path is not the reference's computation
                verdict = "fail"
            if updates.get("passed") is False:  # its steps do not move the weights as the best's do
                verdict = "fail"
            trajectory = _curve_row(c, cur, same_batch_curve) if same_batches(best_recipe, recipe) else None
            if trajectory is not None and not trajectory["passed"]:
                verdict = "fail"  # it trains differently on the best's batches
            cand.real_tokens_per_s, cand.speed_vs_best, cand.noise = c.real_tokens_per_s, ratio, noise
            cand.val_loss, cand.parity_gap, cand.parity = c.val_loss, gap, verdict
            cand.parity_band, cand.parity_against = used.threshold, against
            cand.parity_detectable_effect = used.detectable if used.detectable != float("inf") else None
            if check.get("passed") is False:
                cand.verdict = (
                    f"rejected: batching check: fed the reference's documents and final weights, its "
                    f"batches give a loss {check['gap'] or float('inf'):.2%} off (> {check['tolerance']:.2%})"
                )
            elif updates.get("passed") is False:
                cand.verdict = (
                    f"rejected: update check: from the best's final weights, its steps change them "
                    f"{updates['median_error']:.1%} off the best's (> {updates['tolerance']:.1%})"
                )
            elif trajectory is not None and not trajectory["passed"]:
                cand.verdict = (
                    f"rejected: curve check: on the best's batches its training loss averages "
                    f"{gap_words(trajectory['gap'])} off the best's (> {trajectory['tolerance']:.2%})"
                )
            elif verdict == "fail":
                vs = f" (vs `{against}`, {band_name} band)" if against else ""
                cand.verdict = f"rejected: parity gap {gap:.2%} > {used.threshold:.2%}{vs}"
            elif verdict == "unjudged" and cur.steps < min_steps:
                cand.verdict = "rejected: " + short_run_reason(cur.steps, min_steps)
            elif verdict == "unjudged":
                cand.verdict = (
                    f"rejected: parity unjudged: would catch >= {used.detectable:.1%} "
                    f"(gap {gap:.2%}; a pass needs a run that sees {used.resolution:.0%})"
                )
            elif ratio <= 1:
                cand.verdict = f"rejected: slower ({ratio:.3f}x)"
            elif ratio <= 1 + noise:
                cand.verdict = f"rejected: {ratio:.3f}x is within the noise ({noise:.1%})"
            else:
                cand.verdict = f"faster: {ratio:.3f}x (noise {noise:.1%})"
                if winner is None or ratio > winner[0]:
                    winner = (ratio, list(opt), c)
            candidates.append(cand)
            say(f"  {spec}: {cand.verdict}")
        if winner is None:
            outcome[name] = f"kept {specs[0]}: no candidate beat it beyond the noise at parity"
            best_tps = cur.real_tokens_per_s
            continue
        ratio, opt, c = winner
        for cand in candidates:
            if cand.stage != name or not cand.verdict.startswith("faster"):
                continue
            won = cand.overrides == opt
            cand.verdict = ("kept: " if won else "rejected: another candidate was faster; ") + cand.verdict
        best = _merge(best, tuple(opt))
        kept = resolve_recipe(_spec(base, best))
        if not same_batches(anchor.recipe, kept):  # a change of batching: numerics are judged from here
            anchor = _Anchor(_spec(base, best), kept, c.val_loss)
        elif anchor.recipe is not reference:
            anchor.offset += c.val_loss - cur.val_loss
        best_tps = c.real_tokens_per_s
        speedup *= ratio
        outcome[name] = f"kept {' '.join(opt)} ({ratio:.3f}x)"
        say(f"stage {name}: {outcome[name]}")

    best_spec = _spec(base, best)
    from ..doctor import machine_info

    fixed = ",".join(dict.fromkeys([base, best_spec]))
    bench_command = (
        f"slipstream bench --workload {workload} --size {size} --recipes {fixed} --rounds {rounds}"
        + (f" --round-tokens {round_tokens}" if round_tokens else "")
    )
    return OptimizeResult(
        workload=workload,
        size=size,
        base=base,
        best_spec=best_spec,
        best_overrides=best,
        best_recipe=resolve_recipe(best_spec).to_dict(),
        reference_real_tokens_per_s=ref.contenders[0].real_tokens_per_s,
        best_real_tokens_per_s=best_tps,
        speedup_estimate=speedup,
        parity_band=band.threshold,
        parity_detectable_effect=detectable,
        parity_band_source=band.source,
        reference_val_losses=list(ref.method["parity_noise_val_losses"]),
        candidates=candidates,
        stages=outcome,
        budget_s=budget_s,
        wall_s=time.perf_counter() - t0,
        machine=machine_info(),
        bench_command=bench_command,
        method={
            "rounds": rounds,
            "round_real_tokens": ref.method["round_real_tokens"],
            "real_tokens_per_step": target,
            "min_gain": MIN_GAIN,
            "parity_floor": parity_floor,
            "parity_resolution": parity_resolution,
            "parity_null_sigma": band.sigma,
            "noise_seeds": noise_seeds,
            "parity_steps": parity_steps,
            "parity_min_steps": min_steps,
            "stages": list(stages),
        },
    )


__all__ = ["DEFAULT_STAGES", "STAGES", "Candidate", "OptimizeResult", "Stage", "optimize"]
