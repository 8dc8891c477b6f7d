"""What a trial measures: validation loss of a workload trained under a recipe, or a synthetic
test function (Branin, Hartmann6, Rosenbrock, 1-D valleys) for checking search methods in seconds.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..recipe import Recipe
from .space import ParamSpec, apply_params

# ----------------------------------------------------------------------------- synthetic functions


@dataclass(frozen=True)
class SyntheticFunction:
    name: str
    space: tuple[ParamSpec, ...]
    fn: Callable[[dict[str, float]], float]
    minimum: float
    """The global minimum value (for regret)."""
    minimiser: dict[str, float] | None = None

    def __call__(self, trial: Any) -> float:
        return self.fn({p.name: p.suggest(trial) for p in self.space})


def _branin(p: dict[str, float]) -> float:
    x1, x2 = p["x1"], p["x2"]
    b, c, t = 5.1 / (4 * math.pi**2), 5 / math.pi, 1 / (8 * math.pi)
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


_H_A = np.array(
    [
        [10, 3, 17, 3.5, 1.7, 8],
        [0.05, 10, 17, 0.1, 8, 14],
        [3, 3.5, 1.7, 10, 17, 8],
        [17, 8, 0.05, 10, 0.1, 14],
    ]
)
_H_P = 1e-4 * np.array(
    [
        [1312, 1696, 5569, 124, 8283, 5886],
        [2329, 4135, 8307, 3736, 1004, 9991],
        [2348, 1451, 3522, 2883, 3047, 6650],
        [4047, 8828, 8732, 5743, 1091, 381],
    ]
)
_H_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])


def _hartmann6(p: dict[str, float]) -> float:
    x = np.array([p[f"x{i}"] for i in range(1, 7)])
    return float(-np.sum(_H_ALPHA * np.exp(-np.sum(_H_A * (x - _H_P) ** 2, axis=1))))


def _rosenbrock(p: dict[str, float]) -> float:
    x = [p[f"x{i}"] for i in range(1, 5)]
    return float(sum(100 * (x[i + 1] - x[i] ** 2) ** 2 + (1 - x[i]) ** 2 for i in range(3)))


def shifted_quadratic(shift: float) -> Callable[[dict[str, float]], float]:
    return lambda p: (p["x"] - shift) ** 2


def lr_valley(best_lr: float) -> Callable[[dict[str, float]], float]:
    """A loss-against-learning-rate shape: a slow fall from small learning rates, a steep wall above
    the best one (divergence). Unimodal in log(lr)."""
    c = math.log10(best_lr)

    def f(p: dict[str, float]) -> float:
        u = math.log10(p["lr"]) - c
        return 0.1 * u * u if u < 0 else 0.1 * u * u + math.expm1(2 * u)

    return f


SYNTHETIC: dict[str, SyntheticFunction] = {
    "branin": SyntheticFunction(
        "branin", (ParamSpec("x1", -5.0, 10.0), ParamSpec("x2", 0.0, 15.0)), _branin, 0.397887
    ),
    "hartmann6": SyntheticFunction(
        "hartmann6", tuple(ParamSpec(f"x{i}", 0.0, 1.0) for i in range(1, 7)), _hartmann6, -3.32237
    ),
    "rosenbrock4": SyntheticFunction(
        "rosenbrock4", tuple(ParamSpec(f"x{i}", -5.0, 10.0) for i in range(1, 5)), _rosenbrock, 0.0
    ),
    "quadratic": SyntheticFunction(
        "quadratic", (ParamSpec("x", 0.0, 1.0),), shifted_quadratic(0.3141), 0.0, {"x": 0.3141}
    ),
    "lr-valley": SyntheticFunction(
        "lr-valley", (ParamSpec("lr", 1e-6, 1.0, log=True),), lr_valley(3e-3), 0.0, {"lr": 3e-3}
    ),
}


# ----------------------------------------------------------------------------- workload objective


@dataclass
class WorkloadObjective:
    """Train `workload` under the base recipe with the trial's values; the value is the final
    token-weighted validation loss.

    After every validation (every `eval_every` steps) the loss is reported to Optuna and the
    pruner may stop the trial. With a `slipstream.train` that takes `on_eval`, that is one run;
    otherwise training runs in chunks of `eval_every` steps with a checkpoint in between (resume
    is exact, so a trial trains as one uninterrupted run). A run whose loss turns non-finite is
    pruned (a diverged learning rate is a bad trial, not a crash).
    """

    workload: str
    size: str
    recipe: Recipe
    space: list[ParamSpec]
    steps: int
    eval_every: int
    eval_batches: int = 4
    log: Callable[[str], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def recipe_for(self, params: dict[str, Any], name: str | None = None) -> Recipe:
        return apply_params(self.recipe, params, name=name)

    def __call__(self, trial: Any) -> float:
        import inspect

        import optuna

        from ..train import train

        params = {p.name: p.suggest(trial) for p in self.space}
        recipe = self.recipe_for(params, name=f"trial-{trial.number}")
        every = max(1, min(self.eval_every, self.steps))
        common = dict(size=self.size, eval_every=every, eval_batches=self.eval_batches, progress=False)

        reported: set[int] = set()

        def report(step: int, loss: float) -> None:
            if not math.isfinite(loss):
                raise optuna.TrialPruned(f"validation loss {loss} at step {step}")
            if step == 0 or step in reported:
                return
            reported.add(step)
            trial.report(loss, step)
            if step < self.steps and trial.should_prune():
                raise optuna.TrialPruned(f"val_loss {loss:.4f} at step {step}")

        try:
            if "on_eval" in inspect.signature(train).parameters:
                result = train(self.workload, recipe, self.steps, on_eval=report, **common)
            elif recipe.optimizer.schedule != "constant":
                # A decaying schedule spans the whole run: chunks would each decay on their own
                # length. Without train(on_eval=...) such a trial reports its final loss only.
                result = train(self.workload, recipe, self.steps, **common)
            else:
                result = self._chunked(train, recipe, every, report, common)
        except FloatingPointError as err:
            raise optuna.TrialPruned(f"diverged: {err}") from err
        loss = float(result.val_loss[-1]["loss"])
        report(self.steps, loss)
        return loss

    def _chunked(self, train: Any, recipe: Recipe, every: int, report: Any, common: dict) -> Any:
        ends = list(range(every, self.steps + 1, every))
        if ends[-1] != self.steps:
            ends.append(self.steps)
        with tempfile.TemporaryDirectory(prefix="slipstream-trial-") as ckpt:
            for i, end in enumerate(ends):
                result = train(self.workload, recipe, end, checkpoint_dir=Path(ckpt), resume=i > 0, **common)
                if end < self.steps:
                    report(end, float(result.val_loss[-1]["loss"]))
        return result


__all__ = ["SYNTHETIC", "SyntheticFunction", "WorkloadObjective", "lr_valley", "shifted_quadratic"]
