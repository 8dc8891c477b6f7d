"""The parity guard: does a faster candidate still learn what the reference learns?

One guard for bench, optimize and precision. Every comparison is made at equal real tokens and
equal real tokens per optimizer step (bench and optimize rescale each contender's batches for
that; see slipstream.bench.runner.matched_loader).

The paired guard (bench and optimize, issue 24): every contender starts from the reference's
initial weights and consumes the same documents window by window (slipstream.bench.contenders.
DocumentWindows), so what is left between two runs of harmless recipes is what a harmless change
perturbs: the order and batching of the documents inside each window, and floating-point
reassociation. The null band is measured from exactly that: the reference re-run with another
order inside the same windows (same init, same documents). `null_band` turns those runs into an
allowed gap and the smallest regression the run can detect; `judge_paired` gives the verdict, and
says "unjudged" when the run cannot see a `PARITY_RESOLUTION` (1%) regression.

- `null_band(ref_val, null_vals, floor)`: the band, its spread and its detectable effect.
- `judge_paired(val, ref_val, band)`: pass / fail / unjudged for one validation loss.
- `noise_band(values)`, `judge_parity(val, ref, band, floor)`: the seed-band rule (`paired=False`).
- `parity(candidate_curve, reference_curve, noise_curves=...)`: the same rule on per-step training
  loss curves (precision's use), with a fixed tolerance only when no re-runs are given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PARITY_FLOOR = 0.002
"""Smallest relative gap ever allowed: when the seed re-runs happen to land together, a change
inside ordinary floating-point reassociation noise must still pass."""


def noise_band(reference_losses: Sequence[float]) -> float:
    """The largest relative gap between any two runs of the reference recipe that differ only in
    seed (model init and data order): how far apart "the same training" lands on this run."""
    vals = [float(v) for v in reference_losses if math.isfinite(v)]
    if len(vals) < 2:
        return 0.0
    mean = sum(vals) / len(vals)
    return (max(vals) - min(vals)) / mean if mean else 0.0


def judge_parity(
    val: float, ref_val: float, band: float, floor: float = DEFAULT_PARITY_FLOOR
) -> tuple[str, float, float]:
    """(verdict, gap, allowed): pass when the loss gap to the reference is within the seed noise
    band measured in this run (never below `floor`); a non-finite loss fails."""
    allowed = max(band, floor)
    if not math.isfinite(val):
        return "fail", math.inf, allowed
    gap = abs(val - ref_val) / ref_val if ref_val else 0.0
    return ("pass" if gap <= allowed else "fail"), gap, allowed


PARITY_RESOLUTION = 0.01
"""A verdict is "pass" only when the run would catch a regression this large (relative val loss)
with ~95% probability; otherwise it is "unjudged" (issue 24: the guard must see a 1% regression)."""

NULL_CONFIDENCE = 0.99
"""Two-sided confidence of the allowed gap: a harmless change as noisy as the null re-runs passes
99 times in 100 (at 0.95, 20 harmless runs would all pass only a third of the time)."""

POWER_Z = 1.645
"""One-sided 95% normal quantile: a regression of threshold + POWER_Z x sigma_diff is caught in 95%
of runs (the observed paired gap is the regression plus null noise of sd sigma_diff)."""

_T_995 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355,
          9: 3.250, 10: 3.169, 12: 3.055, 15: 2.947, 20: 2.845, 30: 2.750}  # fmt: skip


def t_quantile_995(df: int) -> float:
    """Student's t 0.995 quantile (two-sided 99%) for `df` degrees of freedom: the factor that
    accounts for a spread estimated from a few runs (df=2: 9.92, vs 2.58 for a known sigma)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    known = [k for k in _T_995 if k <= df]
    return _T_995[max(known)] if df <= 30 else 2.576 + 2.0 / df  # conservative between table rows


@dataclass(frozen=True)
class NullBand:
    """What a harmless change does to the validation loss in this run, and what that lets through."""

    source: str
    """Which runs the spread comes from, in words."""
    val_losses: tuple[float, ...]
    """The reference's validation loss, then each null re-run's."""
    sigma: float
    """Relative standard deviation of one run's validation loss over the null runs (ddof=1)."""
    sigma_diff: float
    """sqrt(2) x sigma: the spread of the paired gap between two runs that differ harmlessly."""
    threshold: float
    """Allowed |val - ref| / ref: max(t(0.995, df) x sigma_diff, floor)."""
    detectable: float
    """Smallest regression caught in ~95% of runs: threshold + 1.645 x sigma_diff (inf without re-runs)."""
    df: int
    floor: float
    resolution: float = PARITY_RESOLUTION
    """A pass needs detectable <= resolution; above it the verdict is "unjudged"."""

    @property
    def spread(self) -> float:
        """Largest relative gap between any two of the runs (the seed band's arithmetic)."""
        return noise_band(self.val_losses)

    @property
    def judged(self) -> bool:
        return self.detectable <= self.resolution

    @property
    def allowed(self) -> float | None:
        """The gap a verdict on this band allows; None without re-runs (df 0): no spread is known,
        so no gap is a detected difference."""
        return self.threshold if self.df else None

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "val_losses": list(self.val_losses),
            "sigma": self.sigma,
            "sigma_diff": self.sigma_diff,
            "threshold": self.threshold,
            "detectable_effect": self.detectable if math.isfinite(self.detectable) else None,
            "df": self.df,
            "floor": self.floor,
            "resolution": self.resolution,
        }


NULL_SOURCE = "the reference re-run with another order of the same documents inside each window (same init)"


def null_band(
    ref_val: float,
    null_vals: Sequence[float],
    floor: float = DEFAULT_PARITY_FLOOR,
    *,
    resolution: float = PARITY_RESOLUTION,
    source: str = NULL_SOURCE,
) -> NullBand:
    """The paired null band from the reference and its harmless re-runs (K >= 1 of them).

    sigma is the sample standard deviation of the K + 1 validation losses over their mean (df = K);
    a contender's paired gap to the reference is then the difference of two such runs, of spread
    sigma_diff = sqrt(2) sigma. The allowed gap is t(0.995, K) sigma_diff (never below `floor`) and
    the detectable effect threshold + 1.645 sigma_diff. Without re-runs nothing is known: the
    threshold is the floor and the detectable effect infinite (every pass is "unjudged")."""
    vals = [float(ref_val), *(float(v) for v in null_vals)]
    finite = [v for v in vals if math.isfinite(v)]
    if len(finite) < 2 or not math.isfinite(ref_val):
        return NullBand(source, tuple(vals), math.nan, math.nan, floor, math.inf, 0, floor, resolution)
    mean = sum(finite) / len(finite)
    sigma = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) / mean
    sigma_diff = math.sqrt(2.0) * sigma
    df = len(finite) - 1
    threshold = max(t_quantile_995(df) * sigma_diff, floor)
    detectable = threshold + POWER_Z * sigma_diff
    return NullBand(source, tuple(vals), sigma, sigma_diff, threshold, detectable, df, floor, resolution)


def relative_gap(value: float, reference: float) -> float:
    """|value - reference| / |reference|, infinite where either is not finite or the reference is 0:
    the gap every paired check (batching, curve, twin) compares with its tolerance."""
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0:
        return math.inf
    return abs(value - reference) / abs(reference)


def gap_words(gap: float | None) -> str:
    """A check row's gap for a message: a percentage, or "not finite" (None or inf)."""
    return "not finite" if gap is None or not math.isfinite(gap) else f"{gap:.2%}"


def judge_paired(val: float, ref_val: float, band: NullBand) -> tuple[str, float]:
    """(verdict, gap) for a contender paired with the reference: "fail" when |gap| exceeds the band's
    threshold (or the loss is not finite) — a detected difference is a difference however weak the
    run; "pass" within it when the run could see a `band.resolution` regression; else "unjudged".
    A band without re-runs (df 0) knows no spread, so no gap is a detected difference: "unjudged"."""
    if not math.isfinite(val):
        return "fail", math.inf
    gap = abs(val - ref_val) / ref_val if ref_val else 0.0
    if band.allowed is None:
        return "unjudged", gap
    if gap > band.threshold:
        return "fail", gap
    return ("pass" if band.judged else "unjudged"), gap


def unjudged_note(name: str, band: NullBand, more: str = "--noise-seeds") -> str:
    """The words bench prints for an unjudged verdict; `more` is the option that adds re-runs to
    that band (bench's --noise-seeds for the order band, --numerics-seeds for the numerics band)."""
    catch = f">= {band.detectable:.1%}" if math.isfinite(band.detectable) else "nothing (no null re-runs)"
    return (
        f"{name}: parity unjudged: would catch {catch}, not a {band.resolution:.0%} regression "
        f"(more null re-runs, {more}, narrow it)"
    )


PARITY_MIN_STEPS = 100
"""Optimizer steps the reference must have trained before a verdict can be "pass". Measured (host B,
docs/bench.md, benchmarks/results/parity-power-*): at 16-27 steps the planted faults (labels
shifted, the first block frozen, pure bf16) cost 0.01-0.55% of validation loss on tiny GPT and Llama
models, inside ordinary noise; at 60-101 steps they cost 0.95-8.6%. A loss-based guard cannot see a
cost that is not there yet, so a shorter run is trained on (bench's extra rounds) or left unjudged."""

PARITY_STEPS_ENV = "SLIPSTREAM_PARITY_STEPS"


def default_parity_steps() -> int:
    """`PARITY_MIN_STEPS`, or the integer in $SLIPSTREAM_PARITY_STEPS (the unit tests set 1: they
    check the machinery on a few steps, not the guard's power)."""
    raw = os.environ.get(PARITY_STEPS_ENV, "").strip()
    if not raw:
        return PARITY_MIN_STEPS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"${PARITY_STEPS_ENV}={raw!r} is not an integer; unset it or give a step count"
        ) from None
    if value < 0:
        raise ValueError(f"${PARITY_STEPS_ENV}={value} must be >= 0")
    return value


def min_judged_steps(parity_steps: int) -> int:
    """Steps a pass needs: `parity_steps` as asked, or `PARITY_MIN_STEPS` when 0 (timing only: no
    extra rounds, and a short run's pass is unjudged rather than trusted)."""
    return parity_steps if parity_steps > 0 else PARITY_MIN_STEPS


def short_run(verdict: str, steps: int, min_steps: int) -> str:
    """A "pass" on a run shorter than `min_steps` optimizer steps is "unjudged"; other verdicts stand
    (a detected difference is a difference however short the run)."""
    return "unjudged" if verdict == "pass" and steps < min_steps else verdict


def short_run_reason(steps: int, min_steps: int) -> str:
    """Why a pass was downgraded by `short_run`, in words."""
    return (
        f"parity unjudged: the reference trained {steps} optimizer steps, fewer than the {min_steps} "
        f"a planted fault needs to show in the loss (--parity-steps {min_steps} trains that long)"
    )


def short_run_note(name: str, steps: int, min_steps: int) -> str:
    """The warning bench prints for the contenders `short_run` downgraded."""
    return f"{name}: {short_run_reason(steps, min_steps)}"


DEFAULT_PARITY_TOLERANCE = 0.02
"""Used only when no seed re-runs are given. Relative gap allowed between the candidate's and the reference's loss, both averaged over the
last `window` steps. Justified by measurement (docs/precision.md, benchmarks/precision.py --parity):
on gpt-stdlib small, 200 steps, bf16 lands 0.12 % from fp32 on the same data and seeds, while an
fp32 run with another seed lands 3.3 % away (the noise floor of "the same training"). 2 % passes
numerics changes ~17x larger than bf16's and fails a candidate that, on the same seeds, ends as far
off as a re-seeded run does (a changed learning rate, broken loss scaling)."""

DEFAULT_PARITY_WINDOW = 20
"""Steps averaged at each end of the comparison: one step's loss is too noisy to compare."""


@dataclass(frozen=True)
class ParityResult:
    passed: bool
    gap: float
    """Relative gap |mean(candidate[-w:]) - mean(reference[-w:])| / mean(reference[-w:])."""
    max_gap: float
    """Largest relative gap between windowed means anywhere along the curves."""
    tolerance: float
    candidate_loss: float
    """Candidate loss averaged over the final window."""
    reference_loss: float
    """Reference loss averaged over the final window."""
    steps: int
    window: int
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {
            "parity_passed": self.passed,
            "parity_gap": self.gap,
            "parity_max_gap": self.max_gap,
            "parity_tolerance": self.tolerance,
            "parity_candidate_loss": self.candidate_loss,
            "parity_reference_loss": self.reference_loss,
            "parity_steps": self.steps,
            "parity_window": self.window,
            "parity_reason": self.reason,
        }


def _final_mean(values: Sequence[float], window: int) -> float:
    tail = [float(v) for v in values][-max(1, min(window, len(values))) :]
    return sum(tail) / len(tail) if tail else math.nan


def _window_means(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        if i >= window - 1:
            out.append(acc / window)
    return out


def parity(
    candidate: Sequence[float],
    reference: Sequence[float],
    *,
    tolerance: float | None = None,
    window: int = DEFAULT_PARITY_WINDOW,
    noise_curves: Sequence[Sequence[float]] = (),
    floor: float = DEFAULT_PARITY_FLOOR,
) -> ParityResult:
    """Compare a candidate loss curve with a reference run on the same data and seeds.

    Pass when the candidate's final-window mean loss is within the tolerance (relative) of the
    reference's, and every value is finite. The tolerance is the seed noise band of the reference
    and `noise_curves` (the reference re-run with other seeds), never below `floor`; with no
    re-runs, `tolerance` or DEFAULT_PARITY_TOLERANCE. The curves are compared over their common
    length."""
    if tolerance is None:
        if noise_curves:
            finals = [_final_mean(c, window) for c in (reference, *noise_curves)]
            tolerance = max(noise_band(finals), floor)
        else:
            tolerance = DEFAULT_PARITY_TOLERANCE
    if tolerance <= 0:
        raise ValueError(f"tolerance={tolerance} must be > 0")
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    n = min(len(candidate), len(reference))
    if n == 0:
        raise ValueError("parity needs two non-empty loss curves (per-step training losses)")
    window = min(window, n)
    cand = [float(x) for x in candidate[:n]]
    ref = [float(x) for x in reference[:n]]
    if not all(math.isfinite(x) for x in ref):
        raise ValueError("the reference loss curve holds inf/nan; it cannot serve as a reference")
    bad = next((i for i, x in enumerate(cand) if not math.isfinite(x)), None)
    cw, rw = _window_means(cand, window) if bad is None else [], _window_means(ref, window)
    if bad is not None:
        return ParityResult(False, math.inf, math.inf, tolerance, math.nan, rw[-1], n, window,
                            f"candidate loss is {cand[bad]} at step {bad + 1}")  # fmt: skip
    rel = [abs(c - r) / max(abs(r), 1e-12) for c, r in zip(cw, rw)]
    gap, max_gap = rel[-1], max(rel)
    passed = gap <= tolerance
    verdict = "within" if passed else "outside"
    reason = (
        f"final {window}-step mean loss {cw[-1]:.4f} vs reference {rw[-1]:.4f}: "
        f"gap {gap:.2%} {verdict} tolerance {tolerance:.2%}"
    )
    return ParityResult(passed, gap, max_gap, tolerance, cw[-1], rw[-1], n, window, reason)


__all__ = [
    "NULL_SOURCE",
    "PARITY_MIN_STEPS",
    "PARITY_STEPS_ENV",
    "default_parity_steps",
    "min_judged_steps",
    "short_run",
    "short_run_note",
    "short_run_reason",
    "PARITY_RESOLUTION",
    "NullBand",
    "gap_words",
    "judge_paired",
    "null_band",
    "relative_gap",
    "unjudged_note",
    "DEFAULT_PARITY_FLOOR",
    "DEFAULT_PARITY_TOLERANCE",
    "DEFAULT_PARITY_WINDOW",
    "ParityResult",
    "judge_parity",
    "noise_band",
    "parity",
]
