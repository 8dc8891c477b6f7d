"""The parity guard: does a faster candidate still learn what the reference learns?

One guard for bench, optimize and precision. "The same training" is judged against the noise of
the training itself: the reference re-run with other seeds (another init and data order) lands
some distance away, and a candidate closer than that has not changed what is learned. Every
comparison is made at equal real tokens and equal real tokens per optimizer step (bench and
optimize rescale each contender's batches for that; see slipstream.bench.runner.matched_loader).

- `noise_band(values)`: the spread of the reference's seed re-runs (final losses).
- `judge_parity(val, ref, band, floor)`: the verdict for one validation loss.
- `parity(candidate_curve, reference_curve, noise_curves=...)`: the same rule on per-step training
  loss curves (precision's use), with a fixed tolerance only when no re-runs are given.
"""

from __future__ import annotations

import math
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
    "DEFAULT_PARITY_FLOOR",
    "DEFAULT_PARITY_TOLERANCE",
    "DEFAULT_PARITY_WINDOW",
    "ParityResult",
    "judge_parity",
    "noise_band",
    "parity",
]
