"""Fibonacci sampler: the L0/F_N bracket, lattice (integer) search, noise, non-unimodal fallback,
statelessness (resume) and behaviour with trials in flight."""

import math

import optuna
import pytest
from optuna.trial import TrialState

from slipstream.tune.fibonacci import FibonacciSampler, fibonacci_numbers, fibonacci_state
from slipstream.tune.objectives import lr_valley

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(sampler, direction="minimize"):
    return optuna.create_study(sampler=sampler, direction=direction)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 12, 20])
@pytest.mark.parametrize("shift", [0.0, 0.137, 0.5, 0.8123, 1.0])
def test_bracket_is_at_most_l0_over_fn_and_holds_the_minimiser(n, shift):
    low, high = -2.0, 3.0
    target = low + shift * (high - low)
    sampler = FibonacciSampler(n, epsilon=0.01)
    study = _study(sampler)
    study.optimize(lambda t: (t.suggest_float("x", low, high) - target) ** 2, n_trials=n)
    st = fibonacci_state(study)
    F = fibonacci_numbers(n)
    assert st.finished and st.evaluations == n
    assert len({t.params["x"] for t in study.trials}) == n  # N distinct evaluations
    assert st.high - st.low <= (1 + 0.01) * (high - low) / F[n] + 1e-12
    assert st.low - 1e-12 <= target <= st.high + 1e-12


@pytest.mark.parametrize("best_lr", [2e-5, 3e-3, 0.4])
def test_log_scale_lr_valley(best_lr):
    n = 14
    study = _study(FibonacciSampler(n))
    f = lr_valley(best_lr)
    study.optimize(lambda t: f({"lr": t.suggest_float("lr", 1e-6, 1.0, log=True)}), n_trials=n)
    st = fibonacci_state(study)
    width_log = math.log(st.high) - math.log(st.low)
    assert width_log <= 1.01 * math.log(1e6) / fibonacci_numbers(n)[n] + 1e-9
    assert st.low <= best_lr <= st.high


def test_maximize():
    study = _study(FibonacciSampler(10), direction="maximize")
    study.optimize(lambda t: -((t.suggest_float("x", -3, 3) - 1.0) ** 2), n_trials=10)
    st = fibonacci_state(study)
    assert st.low <= 1.0 <= st.high and st.high - st.low <= 1.01 * 6 / fibonacci_numbers(10)[10]


@pytest.mark.parametrize("target", [0, 3, 7, 12])
def test_integer_lattice_is_exact_when_the_budget_covers_it(target):
    # F_7 - 1 = 20 >= 13 values: an exact search with at most 6 evaluations.
    study = _study(FibonacciSampler(6))
    study.optimize(lambda t: abs(t.suggest_int("k", 0, 12) - target) + 0.1, n_trials=6)
    st = fibonacci_state(study)
    assert st.finished and st.best_param == target == st.low == st.high
    assert st.evaluations <= 6


def test_integer_lattice_thinned_when_the_range_is_wide():
    n, target = 8, 4321
    study = _study(FibonacciSampler(n))
    study.optimize(lambda t: abs(t.suggest_int("k", 0, 10_000) - target), n_trials=n)
    st = fibonacci_state(study)
    assert st.finished and st.low <= target <= st.high
    # 54 evenly spread candidates: the bracket is two lattice gaps.
    assert st.high - st.low <= 2 * math.ceil(10_000 / (fibonacci_numbers(n + 1)[n + 1] - 2))


def test_repeats_average_noisy_evaluations():
    import random

    rng = random.Random(0)
    study = _study(FibonacciSampler(8, repeats=3, tolerance=0.01))
    study.optimize(lambda t: (t.suggest_float("x", 0, 1) - 0.3) ** 2 + rng.gauss(0, 1e-7), n_trials=24)
    counts = {}
    for t in study.trials:
        counts[t.params["x"]] = counts.get(t.params["x"], 0) + 1
    assert sorted(counts.values()) == [3] * 8
    st = fibonacci_state(study)
    assert st.fallback is None and st.low <= 0.3 <= st.high


def test_not_unimodal_falls_back_with_a_reason():
    # A V at 0.6 with a narrow spike at 0.528: the plan's 4th probe lands on the spike, which is
    # worse than the probes on both sides (0.382 and 0.618) -- impossible for a unimodal function.
    def f(x):
        return abs(x - 0.6) + 3.0 * math.exp(-(((x - 0.528) / 0.02) ** 2))

    sampler = FibonacciSampler(10, fallback=optuna.samplers.RandomSampler(seed=1))
    study = _study(sampler)
    study.optimize(lambda t: f(t.suggest_float("x", 0, 1)), n_trials=25)
    st = fibonacci_state(study)
    assert st.fallback is not None and "not unimodal" in st.fallback
    # After the fallback the trials range over the whole interval again, outside the old bracket.
    xs = [t.params["x"] for t in study.trials[5:]]
    assert any(not st.low <= x <= st.high for x in xs)


def test_stateless_resume_continues_the_plan():
    storage = optuna.storages.InMemoryStorage()
    obj = lambda t: (t.suggest_float("x", 0, 1) - 0.77) ** 2  # noqa: E731
    a = optuna.create_study(storage=storage, study_name="s", sampler=FibonacciSampler(12))
    a.optimize(obj, n_trials=5)
    b = optuna.load_study(storage=storage, study_name="s", sampler=FibonacciSampler(12))  # a "new process"
    b.optimize(obj, n_trials=7)
    ref = _study(FibonacciSampler(12))
    ref.optimize(obj, n_trials=12)
    assert [t.params["x"] for t in b.trials] == [t.params["x"] for t in ref.trials]


def test_trials_in_flight_get_the_other_probe_then_the_bracket():
    study = _study(FibonacciSampler(10, seed=0))
    t0, t1, t2 = study.ask(), study.ask(), study.ask()
    x0, x1, x2 = (t.suggest_float("x", 0, 1) for t in (t0, t1, t2))
    F = fibonacci_numbers(10)
    assert sorted([x0, x1]) == pytest.approx([F[8] / F[10], F[9] / F[10]])  # the two first probes, once each
    assert 0 <= x2 <= 1 and x2 not in (x0, x1)  # nothing planned is free: a point in the bracket
    study.tell(t0, (x0 - 0.2) ** 2)
    study.tell(t1, (x1 - 0.2) ** 2)
    study.tell(t2, state=TrialState.FAIL)
    t3 = study.ask()
    x3 = t3.suggest_float("x", 0, 1)
    assert x3 == pytest.approx(F[7] / F[10])  # the plan's third probe, left of the better one


def test_one_parameter_only():
    study = _study(FibonacciSampler(5))
    study.optimize(
        lambda t: t.suggest_float("x", 0, 1) + t.suggest_float("y", 0, 1), n_trials=1, catch=(ValueError,)
    )
    assert study.trials[0].state == TrialState.FAIL
