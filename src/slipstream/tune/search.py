"""One front over Optuna: pick a method for the search space, open shared storage, run a study
with pruning and several workers, and report the trials and the best one.

Methods (`method=`):
    fibonacci      FibonacciSampler (this package): one numeric parameter
    evolutionary   CMA-ES for numeric spaces; NSGA-II for categorical or multi-objective ones
    bayesian       Gaussian-process sampler for up to 10 numeric parameters; TPE otherwise
    random         uniform random sampling
    auto           1 numeric parameter -> fibonacci; <= 10 numeric -> bayesian (GP, or TPE when
                   trials are pruned); categorical choices -> TPE; > 10 numeric -> CMA-ES;
                   multi-objective -> NSGA-II
    tpe, gp, cmaes, nsga2   the concrete samplers by name

Storage: `None` -> SQLite file `study.db` in the run folder (embedded; several local workers can
share it); `sqlite:///...`, `postgresql://...`, `mysql://...` -> Optuna's RDBStorage with a heartbeat,
so a killed worker's trial turns FAILED after the grace period, is queued once more with the same
parameters (one killed before it drew any is queued to draw afresh), and the others go on; a path ending
in `.journal` (or `journal:PATH`) -> Optuna's journal file (no heartbeat: a killed worker's trial
stays RUNNING).
"""

from __future__ import annotations

import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..recipe import RecipeError
from .space import ParamSpec
from .storage import (
    StudyLock,
    has_module,
    open_storage,
    postgres_driver,
    redact,
    require_optuna,
    storage_url,
)

METHODS = ("auto", "fibonacci", "evolutionary", "bayesian", "random", "tpe", "gp", "cmaes", "nsga2")
PRUNERS = ("median", "halving", "none")
GP_MAX_PARAMS = 10


@dataclass
class MethodChoice:
    method: str
    """The concrete sampler: fibonacci, gp, tpe, cmaes, nsga2 or random."""
    sampler: Any
    reason: str
    """Why this sampler, in one line (printed by the CLI, stored in the JSON)."""


def choose_method(
    method: str,
    space: Sequence[ParamSpec],
    n_trials: int,
    *,
    seed: int | None = None,
    n_objectives: int = 1,
    pruning: bool = False,
) -> MethodChoice:
    """The sampler for `method` over `space` (see the module docstring for the rules).

    With `pruning`, auto and bayesian use TPE where they would use the GP sampler: the GP sampler
    learns from complete trials only, so it proposes a pruned trial's point again and again
    (measured: 9 of 15 trials at one point); TPE ranks pruned trials by how far they got."""
    optuna = require_optuna()
    samplers = optuna.samplers
    if method not in METHODS:
        raise RecipeError(f"--method {method!r}; choose one of {', '.join(METHODS)}")
    if not space:
        raise RecipeError("nothing to search: give at least one --param")
    numeric = [p for p in space if p.numeric]
    n, all_numeric = len(space), len(numeric) == len(space)
    startup = max(4, min(10, n_trials // 3))

    def tpe(why: str) -> MethodChoice:
        return MethodChoice(
            "tpe",
            samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=startup),
            why,
        )

    def gp(why: str) -> MethodChoice:
        if not has_module("scipy"):
            return tpe(f"{why}; but the GP sampler needs scipy (pip install scipy), so TPE")
        return MethodChoice("gp", samplers.GPSampler(seed=seed, n_startup_trials=startup), why)

    def cmaes(why: str) -> MethodChoice:
        if not has_module("cmaes"):
            raise RecipeError(
                "CMA-ES needs the cmaes package: pip install cmaes (or pip install 'slipstream[tune]')"
            )
        return MethodChoice("cmaes", samplers.CmaEsSampler(seed=seed, n_startup_trials=1), why)

    def nsga2(why: str) -> MethodChoice:
        return MethodChoice(
            "nsga2", samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, n_trials // 4))), why
        )

    def fibonacci(why: str) -> MethodChoice:
        if n != 1 or not all_numeric:
            raise RecipeError(
                f"--method fibonacci searches exactly one numeric parameter, got {n} "
                f"({', '.join(p.name for p in space)}); use --method bayesian or auto"
            )
        if n_objectives > 1:
            raise RecipeError("--method fibonacci is single-objective; use --method evolutionary (NSGA-II)")
        from .fibonacci import FibonacciSampler

        return MethodChoice("fibonacci", FibonacciSampler(n_trials, seed=seed), why)

    if method == "fibonacci":
        return fibonacci("asked for")
    if method in ("random",):
        return MethodChoice("random", samplers.RandomSampler(seed=seed), "asked for")
    if method == "tpe":
        return tpe("asked for")
    if method == "gp":
        return gp("asked for")
    if method == "cmaes":
        return cmaes("asked for")
    if method == "nsga2":
        return nsga2("asked for")
    if method == "evolutionary":
        if n_objectives == 1 and all_numeric:
            return cmaes(f"evolutionary over {n} numeric parameter(s): CMA-ES")
        why = "several objectives" if n_objectives > 1 else "categorical choices"
        return nsga2(f"evolutionary with {why}: NSGA-II (genetic)")
    if method == "bayesian":
        if all_numeric and n <= GP_MAX_PARAMS and n_objectives == 1 and pruning:
            return tpe(f"bayesian over {n} numeric parameter(s) with pruning: TPE (GP ignores pruned trials)")
        if all_numeric and n <= GP_MAX_PARAMS and n_objectives == 1:
            return gp(f"bayesian over {n} numeric parameter(s) (<= {GP_MAX_PARAMS}): Gaussian process")
        return tpe(f"bayesian over {n} parameters with categorical choices or more than {GP_MAX_PARAMS}: TPE")
    # auto
    if n_objectives > 1:
        return nsga2(f"auto: {n_objectives} objectives -> NSGA-II")
    if n == 1 and all_numeric:
        return fibonacci(f"auto: one numeric parameter ({space[0].name}) -> Fibonacci search")
    if all_numeric and n <= GP_MAX_PARAMS and pruning:
        return tpe(
            f"auto: {n} numeric parameters (<= {GP_MAX_PARAMS}) with pruning -> TPE "
            "(the Gaussian-process sampler ignores pruned trials and would propose them again)"
        )
    if all_numeric and n <= GP_MAX_PARAMS:
        return gp(
            f"auto: {n} numeric parameters (<= {GP_MAX_PARAMS}) -> Gaussian-process Bayesian optimisation"
        )
    if not all_numeric:
        return tpe(f"auto: {n - len(numeric)} categorical parameter(s) -> TPE")
    if has_module("cmaes"):
        return cmaes(f"auto: {n} numeric parameters (> {GP_MAX_PARAMS}) -> CMA-ES")
    return tpe(f"auto: {n} numeric parameters (> {GP_MAX_PARAMS}) -> TPE (cmaes is not installed)")


def make_pruner(kind: str, *, warmup_steps: int = 0, startup_trials: int = 5) -> Any:
    """median: prune a trial whose loss at a step is worse than the median of earlier trials at that
    step, after `startup_trials` finished trials and not before step `warmup_steps`.
    halving: successive halving whose first rung is at step `warmup_steps` (keeps 1/3 per rung)."""
    optuna = require_optuna()
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_steps)
    if kind == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, warmup_steps), reduction_factor=3)
    if kind == "none":
        return optuna.pruners.NopPruner()
    raise RecipeError(f"--pruner {kind!r}; choose one of {', '.join(PRUNERS)}")


def _space_signature(space: Sequence[ParamSpec]) -> list[str]:
    return [p.describe() for p in space]


FINISHED = ("COMPLETE", "PRUNED")


def _adopt_unbeaten(storage: Any, trials: Sequence[Any], adopted: set[int]) -> None:
    """Beat once for each running trial not seen before, so one without a heartbeat can turn stale.

    Why: a worker killed after Optuna created its trial (RUNNING) but before the first heartbeat
    (while the sampler draws relative parameters, which takes seconds for the GP sampler) leaves a
    trial Optuna never calls stale, since it has no beat to age, and the survivors wait on it
    forever (seen once as a resumed `tune` that stalled). Called under the study lock, where every
    live worker's running trial has already beaten: one beat more for a live trial is harmless, and
    a dead one is failed (and retried) a grace period later. Once per trial, so a dead trial's own
    stale beat is renewed at most once."""
    from optuna.trial import TrialState

    for t in trials:
        if t.state == TrialState.RUNNING and t._trial_id not in adopted:
            storage.record_heartbeat(t._trial_id)
            adopted.add(t._trial_id)


def run_study(
    objective: Callable[[Any], float],
    space: Sequence[ParamSpec],
    *,
    study_name: str,
    storage: Any,
    n_trials: int,
    method: str = "auto",
    seed: int | None = None,
    pruner: Any = None,
    direction: str = "minimize",
    enqueue: dict[str, Any] | None = None,
    on_trial: Callable[[Any, Any], None] | None = None,
    poll_s: float = 0.5,
) -> tuple[Any, MethodChoice]:
    """Run (or resume, or join) a study until it holds `n_trials` finished trials.

    Several processes may call this with the same `study_name` and storage: each one runs trials
    until the study has `n_trials` finished (complete or pruned) ones, counting other workers'
    running trials; with a heartbeat storage it waits for those and takes over when one goes
    stale (its worker died: the trial is marked FAILED; one that died before its first heartbeat
    is given one, so it turns stale too). Resuming is the same call again.
    `enqueue` puts one parameter set first (the base recipe, for comparison) in a new study.
    Returns (study, method choice)."""
    optuna = require_optuna()
    from optuna.trial import TrialState

    if n_trials < 1:
        raise RecipeError(f"--trials {n_trials}: must be at least 1")
    study = optuna.create_study(
        storage=storage,
        sampler=optuna.samplers.RandomSampler(),  # replaced below, once the stored trials are known
        pruner=pruner,
        study_name=study_name,
        direction=direction,
        load_if_exists=True,
    )
    pruning = pruner is not None and not isinstance(pruner, optuna.pruners.NopPruner)
    choice = choose_method(method, space, n_trials, seed=seed, pruning=pruning)
    study.sampler = choice.sampler
    signature = _space_signature(space)
    stored = study.user_attrs.get("slipstream_space")
    if stored is None:
        study.set_user_attr("slipstream_space", signature)
        study.set_user_attr("slipstream_method", choice.method)
        if enqueue is not None and not study.trials:
            study.enqueue_trial(enqueue, user_attrs={"slipstream_base": True})
    elif stored != signature:
        raise RecipeError(
            f"study {study_name!r} was created for {'; '.join(stored)}, not {'; '.join(signature)}; "
            "resume with the same --param list, or pick a new --study name"
        )
    heartbeat = isinstance(storage, optuna.storages.RDBStorage)
    worker = f"{socket.gethostname()}:{os.getpid()}"

    lock = StudyLock(storage, study_name)
    seeded = False
    adopted: set[int] = set()

    def wrapped(trial: Any) -> float:
        if heartbeat:
            # Optuna's heartbeat thread writes its first beat a moment after the trial starts; a
            # worker killed before it leaves a RUNNING trial that never turns stale. Beat now.
            storage.record_heartbeat(trial._trial_id)
        trial.set_user_attr("slipstream_worker", worker)
        # Draw and store every parameter before the next worker may ask (the objective's own
        # suggest calls get these values back): it then sees this point among the running trials.
        for p in space:
            p.suggest(trial)
        lock.release()
        return objective(trial)

    def callback(study: Any, trial: Any) -> None:
        if on_trial is not None:
            on_trial(study, trial)
        if choice.method == "fibonacci":
            from .fibonacci import fibonacci_state

            if fibonacci_state(study).finished:
                study.set_user_attr("slipstream_fibonacci_finished", True)

    try:
        while True:
            if heartbeat:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)
            lock.acquire()  # count and ask under the lock: see StudyLock
            trials = study.get_trials(deepcopy=False)
            if heartbeat and lock.exclusive:
                _adopt_unbeaten(storage, trials, adopted)
            finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if finished >= n_trials or study.user_attrs.get("slipstream_fibonacci_finished"):
                break
            if finished + running >= n_trials:
                lock.release()
                if not heartbeat:
                    break  # no heartbeat: nobody can tell a dead worker's trial from a slow one
                time.sleep(poll_s)  # wait for other workers' trials, or for them to turn stale
                continue
            if seed is not None and not seeded:
                # Offset the seed by the trials stored: a resumed study does not replay its draws,
                # and workers given one --seed do not draw the same points (each counts the
                # trials its predecessors under the lock made).
                offset = seed + len(trials)
                choice.sampler = choose_method(method, space, n_trials, seed=offset, pruning=pruning).sampler
                study.sampler = choice.sampler
                seeded = True
            study.optimize(wrapped, n_trials=1, callbacks=[callback], gc_after_trial=False)
            lock.release()  # already released by wrapped, unless the trial failed before it
    finally:
        lock.close()
    return study, choice


# ----------------------------------------------------------------------------- results


def trial_record(trial: Any) -> dict[str, Any]:
    return {
        "number": trial.number,
        "params": dict(trial.params),
        "value": trial.value if trial.values is not None else None,
        "state": trial.state.name,
        "intermediate": {str(k): v for k, v in sorted(trial.intermediate_values.items())},
        "duration_s": trial.duration.total_seconds() if trial.duration is not None else None,
        "base": bool(trial.user_attrs.get("slipstream_base", False)),
        "worker": trial.user_attrs.get("slipstream_worker"),
    }


def best_trial(study: Any) -> Any | None:
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    done = [t for t in done if math.isfinite(t.value)]
    if not done:
        return None
    sign = 1 if study.direction.name == "MINIMIZE" else -1
    return min(done, key=lambda t: sign * t.value)


def summarize(study: Any, choice: MethodChoice, storage: str) -> dict[str, Any]:
    """The JSON payload: study, method, trials (params, value, state) and best (params, value)."""
    trials = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    best = best_trial(study)
    base = next((t for t in trials if t["base"] and t["state"] == "COMPLETE"), None)
    out: dict[str, Any] = {
        "study": study.study_name,
        "storage": redact(storage),
        "direction": study.direction.name.lower(),
        "method": choice.method,
        "method_reason": choice.reason,
        "trials": trials,
        "states": {
            s: sum(t["state"] == s for t in trials) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
        },
        "best": None
        if best is None
        else {"number": best.number, "params": dict(best.params), "value": best.value, "recipe_path": None},
        "base": None if base is None else {"params": base["params"], "value": base["value"]},
    }
    if choice.method == "fibonacci" and best is not None:
        from .fibonacci import fibonacci_state

        out["fibonacci"] = fibonacci_state(study).to_dict()
    return out


__all__ = [
    "METHODS",
    "PRUNERS",
    "MethodChoice",
    "StudyLock",
    "best_trial",
    "choose_method",
    "make_pruner",
    "open_storage",
    "postgres_driver",
    "require_optuna",
    "run_study",
    "storage_url",
    "summarize",
    "trial_record",
]
