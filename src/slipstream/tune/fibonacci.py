"""Fibonacci search for one parameter, as an Optuna sampler.

Classic interval reduction (Kiefer, 1953): to minimise a unimodal f on [a, b] with N evaluations,
probe the two points that split the interval by consecutive Fibonacci ratios, keep the side that
holds the better one, and reuse that point in the next, smaller interval. After N evaluations the
bracket that must hold the minimiser has width L0 / F_N (F_0 = F_1 = 1, F_2 = 2, ...) plus the
small offset `epsilon * L0 / F_N` of the last probe: both points of the final step would fall on
the middle, so the last one is moved aside. No method with N evaluations guarantees less.

Search coordinates: the parameter itself, or its logarithm for `log=True` distributions. Integer
parameters (and floats with a `step`) are searched on their lattice (lattice Fibonacci search):
when F_{N+1} - 1 covers every allowed value the search is exact, otherwise it runs on an evenly
thinned lattice and the bracket is the two lattice neighbours of the best point. Log-scale
integers use the continuous search in log space, rounded.

The sampler holds no state of its own: every call replays the plan from the study's trials, so it
works with any storage, survives a restart and shows in the dashboard like any other sampler.
`fibonacci_state(study)` replays it to report the bracket.

Noise and functions that are not unimodal:
- `repeats=r` evaluates every planned point r times and compares the means.
- Before each proposal the sampler checks all finished evaluations for a bump that no unimodal
  function has (a point worse than a point on each side by more than `tolerance`). At the first
  bump it stops narrowing, says why in `fibonacci_state(...).fallback`, and hands the remaining
  trials to the `fallback` sampler (TPE by default) over the whole range. Set `tolerance` to the
  noise's size so noise alone does not trigger it.
- Pruned trials count as +inf (worse than anything); failed trials are proposed again.
- Fibonacci search is sequential: with several workers, a worker that would wait for another's
  point instead samples uniformly inside the current bracket (extra evaluations the plan does not
  rely on). After the plan ends, further trials also sample inside the final bracket.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler, TPESampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState


def fibonacci_numbers(n: int) -> list[int]:
    """F_0..F_n with F_0 = F_1 = 1."""
    f = [1, 1]
    while len(f) <= n:
        f.append(f[-1] + f[-2])
    return f[: n + 1]


@dataclass
class FibonacciState:
    """Where the search stands, replayed from the study's trials."""

    param: str
    low: float
    """Bracket that holds the minimiser (for a unimodal objective), in parameter units."""
    high: float
    best_value: float | None
    """Best objective value among the planned evaluations (as the study reports it)."""
    best_param: float | None
    evaluations: int
    """Distinct planned points evaluated so far."""
    planned: int
    """N: the evaluations the plan was made for."""
    finished: bool
    width_ratio: float
    """Bracket width / initial width, in search coordinates (log for log-scale parameters)."""
    bound_ratio: float
    """The plan's guarantee: 1 / F_N (times 1 + epsilon for the continuous search)."""
    next_points: list[Any] = field(default_factory=list)
    """Parameter values the plan needs next (none once finished)."""
    fallback: str | None = None
    """Why the search stopped narrowing (a bump that no unimodal function has), or None."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "next_points"}


class _Coords:
    """Maps a distribution to search coordinates and back."""

    def __init__(self, dist: BaseDistribution):
        if not isinstance(dist, (FloatDistribution, IntDistribution)):
            raise ValueError(
                f"Fibonacci search needs a numeric parameter, got {type(dist).__name__}; "
                "use --method bayesian for categorical choices"
            )
        self.dist = dist
        self.is_int = isinstance(dist, IntDistribution)
        step = dist.step
        self.lattice = not dist.log and (self.is_int or step is not None)
        if self.lattice:
            self.step = step if step is not None else 1
            self.n_values = int(round((dist.high - dist.low) / self.step)) + 1
        else:
            self.lo = math.log(dist.low) if dist.log else float(dist.low)
            self.hi = math.log(dist.high) if dist.log else float(dist.high)

    def value_of(self, u: float) -> Any:
        d = self.dist
        if self.lattice:
            v = d.low + int(u) * self.step
            return int(v) if self.is_int else float(v)
        x = math.exp(u) if d.log else u
        if self.is_int:
            return int(min(d.high, max(d.low, round(x))))
        return float(min(d.high, max(d.low, x)))

    def coord_of(self, value: Any) -> float:
        if self.lattice:
            return (value - self.dist.low) / self.step
        return math.log(value) if self.dist.log else float(value)

    @staticmethod
    def key(value: Any) -> Any:
        return value if isinstance(value, int) else float(f"{value:.12g}")


class _Observations:
    """Finished evaluations of the parameter, keyed by value (mean of repeats; pruned = +inf)."""

    def __init__(self, trials: list[FrozenTrial], param: str, sign: float, exclude: int | None):
        self.values: dict[Any, list[float]] = {}
        self.running: dict[Any, int] = {}
        self.coords: dict[Any, float] = {}
        for t in trials:
            if param not in t.params or t.number == exclude:
                continue
            k = _Coords.key(t.params[param])
            if t.state == TrialState.COMPLETE and t.value is not None:
                self.values.setdefault(k, []).append(sign * t.value)
            elif t.state == TrialState.PRUNED:
                self.values.setdefault(k, []).append(math.inf)
            elif t.state == TrialState.RUNNING:
                self.running[k] = self.running.get(k, 0) + 1
            self.coords.setdefault(k, math.nan)

    def mean(self, key: Any, repeats: int) -> float | None:
        vals = self.values.get(key, [])
        if len(vals) < repeats:
            return None
        return math.inf if any(math.isinf(v) for v in vals) else float(np.mean(vals))

    def pending(self, key: Any, repeats: int) -> int:
        """How many more evaluations this point needs that nobody is running yet."""
        return repeats - len(self.values.get(key, [])) - self.running.get(key, 0)


class _NeedMore(Exception):
    """The plan needs these points evaluated before it can go on; `bracket` is where it stands."""

    def __init__(self, points: list[Any], bracket: tuple[Any, Any] | None = None):
        self.points = points
        self.bracket = bracket


def _bump(points: list[tuple[float, float]], tolerance: float) -> str | None:
    """A point worse than a point on each side by more than `tolerance`: impossible if unimodal."""
    pts = sorted((c, v) for c, v in points if math.isfinite(v))
    if len(pts) < 3:
        return None
    vals = [v for _, v in pts]
    left_min = np.minimum.accumulate(vals)
    right_min = np.minimum.accumulate(vals[::-1])[::-1]
    for j in range(1, len(vals) - 1):
        if vals[j] > left_min[j - 1] + tolerance and vals[j] > right_min[j + 1] + tolerance:
            return f"not unimodal: evaluation {j + 1} of {len(vals)} (by position) is worse than points on both sides"
    return None


def _replay_continuous(
    lo: float, hi: float, n: int, epsilon: float, f: Callable[[float], float | None]
) -> tuple[float, float, float | None, int, bool]:
    """Play the plan; returns (a, b, best coordinate, evaluations, finished) or raises _NeedMore."""
    fib = fibonacci_numbers(max(n, 2))
    L0 = hi - lo
    a, b = lo, hi
    offset = epsilon * L0 / fib[n]
    if n == 1:
        m = (a + b) / 2
        if f(m) is None:
            raise _NeedMore([m])
        return a, b, m, 1, True
    k = n
    if n == 2:
        c, d = (a + b) / 2, (a + b) / 2 + offset
    else:
        c, d = a + fib[k - 2] / fib[k] * (b - a), a + fib[k - 1] / fib[k] * (b - a)
    fc, fd = f(c), f(d)
    missing = [x for x, fx in ((c, fc), (d, fd)) if fx is None]
    if missing:
        raise _NeedMore(missing)
    used = 2
    while True:
        if fc <= fd:  # the minimiser is in [a, d]; c stays as the upper probe
            b, kept, fk, kept_is_lower = d, c, fc, False
        else:  # the minimiser is in [c, b]; d stays as the lower probe
            a, kept, fk, kept_is_lower = c, d, fd, True
        k -= 1
        if used == n:
            return a, b, kept, used, True
        if k == 2:  # both probes would sit on the middle: move the new one aside
            x = kept + offset if kept + offset < b else kept - offset
        elif kept_is_lower:
            x = a + fib[k - 1] / fib[k] * (b - a)
        else:
            x = a + fib[k - 2] / fib[k] * (b - a)
        fx = f(x)
        if fx is None:
            raise _NeedMore([x], (a, b))
        used += 1
        (c, fc), (d, fd) = sorted([(kept, fk), (x, fx)])


def _replay_lattice(
    n_values: int, n: int, f: Callable[[int], float | None]
) -> tuple[int, int, int, int, bool]:
    """Lattice Fibonacci search over candidates 0..n_values-1 (thinned to fit n evaluations).

    Returns (low index, high index, best index, evaluations, finished); raises _NeedMore."""
    fib = fibonacci_numbers(n + 2)
    count = min(n_values, fib[n + 1] - 1)
    # Candidates spread evenly over the lattice (all of it when it fits the budget).
    cands = [round(j * (n_values - 1) / (count - 1)) for j in range(count)] if count > 1 else [0]
    k = 2
    while fib[k] - 1 < count:
        k += 1

    def g(pos: int) -> float | None:
        if pos > count:  # padding beyond the lattice: worse than anything, costs nothing
            return math.inf
        return f(cands[pos - 1])

    A, B = 0, fib[k]
    bracket_of = lambda pos: (cands[max(pos - 2, 0)], cands[min(pos, count - 1)])  # noqa: E731
    if k == 2:
        v = g(1)
        if v is None:
            raise _NeedMore([cands[0]])
        return cands[0], cands[0], cands[0], 1, True
    c, d = A + fib[k - 2], A + fib[k - 1]
    fc, fd = g(c), g(d)
    missing = [cands[p - 1] for p, v in ((c, fc), (d, fd)) if v is None]
    if missing:
        raise _NeedMore(missing)
    evaluated = sum(p <= count for p in (c, d))
    while True:
        if fc <= fd:
            B, kept, fk = d, c, fc
        else:
            A, kept, fk = c, d, fd
        k -= 1
        if B - A <= 2:
            lo, hi = bracket_of(kept) if count < n_values else (cands[kept - 1], cands[kept - 1])
            return lo, hi, cands[kept - 1], evaluated, True
        x = A + fib[k - 2] if kept == A + fib[k - 1] else A + fib[k - 1]
        fx = g(x)
        if fx is None:
            raise _NeedMore([cands[x - 1]], (cands[max(A, 1) - 1], cands[min(B, count) - 1]))
        evaluated += x <= count
        (c, fc), (d, fd) = sorted([(kept, fk), (x, fx)])


class FibonacciSampler(BaseSampler):
    """Fibonacci search over the study's one parameter (see the module docstring).

    n_evaluations: N, the distinct points the plan spends (trials = N x repeats).
    repeats: evaluations per point, averaged (for noisy objectives).
    tolerance: how much worse a point must be than both sides to count as a bump (noise level).
    epsilon: the last probe's offset, as a fraction of the final bracket L0 / F_N.
    fallback: sampler for the rest of the study once the objective shows it is not unimodal
        (default TPE with `seed`).
    """

    def __init__(
        self,
        n_evaluations: int,
        *,
        repeats: int = 1,
        tolerance: float = 0.0,
        epsilon: float = 0.01,
        fallback: BaseSampler | None = None,
        seed: int | None = None,
    ):
        if n_evaluations < 1:
            raise ValueError(f"n_evaluations must be at least 1, got {n_evaluations}")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        if not 0 < epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.n_evaluations = n_evaluations
        self.repeats = repeats
        self.tolerance = tolerance
        self.epsilon = epsilon
        self._fallback = fallback if fallback is not None else TPESampler(seed=seed)
        self._random = RandomSampler(seed=seed)
        self._param: str | None = None

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()
        self._random.reseed_rng()

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if len(study.directions) > 1:
            raise ValueError("FibonacciSampler is single-objective; use --method evolutionary (NSGA-II)")
        if self._param is None:
            self._param = _first_param(study) or param_name
        if param_name != self._param:
            raise ValueError(
                f"FibonacciSampler searches one parameter ({self._param!r}) and the objective also asks "
                f"for {param_name!r}; use --method bayesian or evolutionary for several parameters"
            )
        state = self.state(study, param_name, param_distribution, exclude=trial.number)
        if state.fallback is not None:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        obs = self._observations(study, param_name, trial.number)
        for value in state.next_points:
            if obs.pending(_Coords.key(value), self.repeats) > 0:
                return value
        # Waiting on another worker's point, or the plan is over: sample inside the bracket.
        if state.high > state.low:
            d = param_distribution
            inner = type(d)(low=state.low, high=state.high, log=d.log, step=d.step)  # type: ignore[call-arg]
            return self._random.sample_independent(study, trial, param_name, inner)
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def _observations(self, study: optuna.Study, param: str, exclude: int | None) -> _Observations:
        sign = -1.0 if study.direction == StudyDirection.MAXIMIZE else 1.0
        trials = study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        )
        return _Observations(trials, param, sign, exclude)

    def state(
        self,
        study: optuna.Study,
        param_name: str,
        distribution: BaseDistribution,
        exclude: int | None = None,
    ) -> FibonacciState:
        """Replay the plan over the study's finished trials."""
        coords = _Coords(distribution)
        obs = self._observations(study, param_name, exclude)
        sign = -1.0 if study.direction == StudyDirection.MAXIMIZE else 1.0
        seen: list[tuple[float, float]] = []

        def f(value: Any) -> float | None:
            v = obs.mean(_Coords.key(value), self.repeats)
            if v is not None:
                seen.append((coords.coord_of(value), v))
            return v

        n = self.n_evaluations
        fib = fibonacci_numbers(n + 1)
        next_points: list[Any] = []
        finished = False
        if coords.lattice:
            try:
                lo, hi, best, used, finished = _replay_lattice(
                    coords.n_values, n, lambda i: f(coords.value_of(i))
                )
                low, high, best_param = coords.value_of(lo), coords.value_of(hi), coords.value_of(best)
            except _NeedMore as need:
                next_points = [coords.value_of(i) for i in need.points]
                lo, hi = need.bracket or (0, coords.n_values - 1)
                low, high, best_param, used = coords.value_of(lo), coords.value_of(hi), None, len(seen)
            width = (coords.coord_of(high) - coords.coord_of(low)) / max(1, coords.n_values - 1)
            bound = 1.0 / fib[n]
        else:
            try:
                a, b, best, used, finished = _replay_continuous(
                    coords.lo, coords.hi, n, self.epsilon, lambda u: f(coords.value_of(u))
                )
                best_param = coords.value_of(best)
            except _NeedMore as need:
                next_points = [coords.value_of(u) for u in need.points]
                a, b = need.bracket or (coords.lo, coords.hi)
                best_param, used = None, len(seen)
            low, high = coords.value_of(a), coords.value_of(b)
            width = (b - a) / (coords.hi - coords.lo)
            bound = (1.0 + self.epsilon) / fib[n]
        # Every finished evaluation counts for the unimodality check, planned or not.
        all_points = [(coords.coord_of(k), obs.mean(k, 1)) for k in obs.values]
        fallback = _bump([(c, v) for c, v in all_points if v is not None], self.tolerance)
        best_value = None
        if best_param is not None:
            m = obs.mean(_Coords.key(best_param), self.repeats)
            best_value = None if m is None else sign * m
        return FibonacciState(
            param=param_name,
            low=low,
            high=high,
            best_value=best_value,
            best_param=best_param,
            evaluations=used,
            planned=n,
            finished=finished,
            width_ratio=width,
            bound_ratio=bound,
            next_points=next_points,
            fallback=fallback,
        )


def _first_param(study: optuna.Study) -> str | None:
    for t in study.get_trials(deepcopy=False):
        if t.params:
            return next(iter(t.params))
    return None


def fibonacci_state(study: optuna.Study) -> FibonacciState:
    """The bracket and progress of a study run with a FibonacciSampler."""
    sampler = study.sampler
    if not isinstance(sampler, FibonacciSampler):
        raise ValueError(f"study {study.study_name!r} does not use a FibonacciSampler")
    for t in study.get_trials(deepcopy=False):
        if t.distributions:
            name, dist = next(iter(t.distributions.items()))
            return sampler.state(study, name, dist)
    raise ValueError(f"study {study.study_name!r} has no trials yet")


__all__ = ["FibonacciSampler", "FibonacciState", "fibonacci_numbers", "fibonacci_state"]
