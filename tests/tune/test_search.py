"""The search front: method choice by search space, --param parsing, storage, pruning, resume."""

import optuna
import pytest
from optuna.trial import TrialState

from slipstream.recipe import Recipe, RecipeError
from slipstream.tune import search
from slipstream.tune.fibonacci import FibonacciSampler
from slipstream.tune.search import choose_method, make_pruner, open_storage, run_study, summarize
from slipstream.tune.space import ParamSpec, apply_params, base_params, parse_param

F = ParamSpec("a", 0.0, 1.0)
C = ParamSpec("c", choices=("x", "y"))


def _floats(n):
    return [ParamSpec(f"p{i}", 0.0, 1.0) for i in range(n)]


@pytest.mark.parametrize(
    "method, space, expected",
    [
        ("auto", [F], "fibonacci"),
        ("auto", [ParamSpec("k", 0, 9, integer=True)], "fibonacci"),
        ("auto", _floats(2), "gp"),
        ("auto", _floats(10), "gp"),
        ("auto", _floats(11), "cmaes"),
        ("auto", [F, C], "tpe"),
        ("bayesian", _floats(3), "gp"),
        ("bayesian", [F, C], "tpe"),
        ("evolutionary", _floats(3), "cmaes"),
        ("evolutionary", [F, C], "nsga2"),
        ("random", [F], "random"),
        ("fibonacci", [F], "fibonacci"),
    ],
)
def test_method_choice_follows_the_search_space(method, space, expected):
    choice = choose_method(method, space, 20, seed=0)
    assert choice.method == expected and choice.reason
    names = {
        "fibonacci": FibonacciSampler,
        "gp": optuna.samplers.GPSampler,
        "cmaes": optuna.samplers.CmaEsSampler,
        "tpe": optuna.samplers.TPESampler,
        "nsga2": optuna.samplers.NSGAIISampler,
        "random": optuna.samplers.RandomSampler,
    }
    assert isinstance(choice.sampler, names[expected])


def test_pruning_steers_bayesian_from_gp_to_tpe():
    # GP learns from complete trials only and would propose a pruned point again.
    for method in ("auto", "bayesian"):
        choice = choose_method(method, _floats(2), 15, pruning=True)
        assert choice.method == "tpe" and "prun" in choice.reason
    assert choose_method("auto", _floats(2), 15, pruning=False).method == "gp"


def test_auto_multi_objective_and_missing_scipy(monkeypatch):
    assert choose_method("auto", _floats(2), 20, n_objectives=2).method == "nsga2"
    monkeypatch.setattr(search, "has_module", lambda m: m != "scipy")
    choice = choose_method("auto", _floats(2), 20)
    assert choice.method == "tpe" and "scipy" in choice.reason


def test_fibonacci_refuses_two_parameters():
    with pytest.raises(RecipeError, match="exactly one numeric parameter"):
        choose_method("fibonacci", _floats(2), 10)
    with pytest.raises(RecipeError, match="--method"):
        choose_method("simplex", [F], 10)


def test_parse_param_forms_and_errors():
    p = parse_param("lr=1e-4:1e-2:log")
    assert (p.name, p.low, p.high, p.log, p.integer) == ("optimizer.lr", 1e-4, 1e-2, True, False)
    w = parse_param("warmup=0:40")
    assert w.name == "optimizer.warmup_steps" and w.integer  # an int field searches integers
    s = parse_param("schedule=constant,cosine")
    assert s.choices == ("constant", "cosine")
    for bad, msg in [
        ("lr", "must look like"),
        ("lr=1e-2:1e-4", "LOW must be below HIGH"),
        ("lr=0:1:log", "LOW > 0"),
        ("nope.field=0:1", "not a recipe field"),
        ("warmup=0.5:4", "whole-number"),
        ("lr=1e-4:1e-2:cubic", "unknown flag"),
        ("schedule=0:1", "choices"),
        ("lr=1e-3", "two choices"),
    ]:
        with pytest.raises(RecipeError, match=msg):
            parse_param(bad)


def test_apply_and_base_params():
    space = [parse_param("lr=1e-4:1e-2:log"), parse_param("warmup=0:40")]
    r = apply_params(Recipe(), {"optimizer.lr": 3e-3, "optimizer.warmup_steps": 7}, name="t")
    assert (r.optimizer.lr, r.optimizer.warmup_steps, r.name) == (3e-3, 7, "t")
    assert base_params(Recipe(), space) == {"optimizer.lr": 1e-3, "optimizer.warmup_steps": 0}
    assert base_params(Recipe().override("optimizer.lr=0.5"), space) is None
    with pytest.raises(RecipeError, match="optimizer.warmup_steps"):
        apply_params(Recipe(), {"optimizer.warmup_steps": -1})


def test_storage_kinds_and_errors(tmp_path, monkeypatch):
    assert isinstance(open_storage(None, tmp_path), optuna.storages.RDBStorage)
    assert (tmp_path / "study.db").exists()
    j = open_storage(str(tmp_path / "s.journal"), tmp_path)
    assert isinstance(j, optuna.storages.JournalStorage)
    with pytest.raises(RecipeError, match="not a database URL"):
        open_storage("runs/study", tmp_path)
    # PostgreSQL: the same RDBStorage path with a heartbeat (the call; test_postgres_workers.py
    # runs a real server).
    seen = {}

    class FakeRDB:
        def __init__(self, url, **kw):
            seen.update(kw, url=url)

    monkeypatch.setattr(optuna.storages, "RDBStorage", FakeRDB)
    open_storage("postgresql://u:pw@db.example/optuna", tmp_path, heartbeat_interval=7)
    assert (
        seen["url"] == "postgresql+psycopg://u:pw@db.example/optuna"
    )  # the driver slipstream[tune] installs
    assert seen["heartbeat_interval"] == 7 and seen["grace_period"] == 14


def test_bare_postgresql_url_names_the_installed_driver(monkeypatch):
    # SQLAlchemy 2.0 reads a bare postgresql:// as psycopg2, 2.1 as psycopg (3): name what is there.
    from slipstream.tune import storage

    installed = {"psycopg"}
    monkeypatch.setattr(storage, "has_module", lambda m: m in installed)
    assert storage.postgres_driver("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    installed = {"psycopg2"}
    assert storage.postgres_driver("postgresql://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert storage.postgres_driver("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert storage.postgres_driver("sqlite:///x.db") == "sqlite:///x.db"


def test_unreachable_database_is_a_clear_error(tmp_path):
    with pytest.raises(RecipeError, match="cannot open study storage|driver is missing"):
        open_storage("postgresql://user:secret@127.0.0.1:1/optuna", tmp_path)


def _objective(trial):
    return (trial.suggest_float("a", 0.0, 1.0) - 0.25) ** 2


def test_resume_continues_from_stored_trials(tmp_path):
    storage = open_storage(None, tmp_path)
    s1, _ = run_study(_objective, [F], study_name="r", storage=storage, n_trials=4, method="random", seed=3)
    first = [t.params["a"] for t in s1.trials]
    # "Stopped half-way": the same call with a larger target continues; nothing is redone.
    s2, _ = run_study(
        _objective,
        [F],
        study_name="r",
        storage=open_storage(None, tmp_path),
        n_trials=9,
        method="random",
        seed=3,
    )
    trials = s2.get_trials()
    assert len(trials) == 9 and [t.params["a"] for t in trials[:4]] == first
    assert [t.number for t in trials] == list(range(9))
    assert len({t.params["a"] for t in trials}) == 9  # the offset seed does not replay the first draws
    # Already complete: a third call runs nothing.
    s3, _ = run_study(_objective, [F], study_name="r", storage=storage, n_trials=9, method="random")
    assert len(s3.trials) == 9


def test_resume_with_another_space_is_refused(tmp_path):
    storage = open_storage(None, tmp_path)
    run_study(_objective, [F], study_name="r", storage=storage, n_trials=1, method="random")
    with pytest.raises(RecipeError, match="was created for"):
        run_study(_objective, [ParamSpec("a", 0.0, 2.0)], study_name="r", storage=storage, n_trials=2)


def test_fibonacci_study_stops_when_the_plan_is_done(tmp_path):
    space = [ParamSpec("k", 0, 12, integer=True)]
    study, choice = run_study(
        lambda t: abs(t.suggest_int("k", 0, 12) - 5), space, study_name="f", storage=None, n_trials=10
    )
    assert choice.method == "fibonacci"
    assert len(study.trials) <= 6  # exact after at most 6 lattice probes: no wasted trials
    out = summarize(study, choice, "memory")
    assert out["fibonacci"]["best_param"] == 5 and out["best"]["params"] == {"k": 5}


def test_median_pruner_stops_a_bad_curve_after_warmup():
    curves = [[5, 4, 3, 2]] * 3 + [[5, 6, 7, 8], [9, 9, 9, 9]]
    it = iter(curves)

    def objective(trial):
        trial.suggest_float("a", 0, 1)
        curve = next(it)
        for step, v in enumerate(curve, start=1):
            trial.report(v, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return curve[-1]

    study = optuna.create_study(pruner=make_pruner("median", warmup_steps=2, startup_trials=3))
    study.optimize(objective, n_trials=5)
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE] * 3 + [TrialState.PRUNED] * 2
    # The warm-up: nothing is pruned before step 2, however bad (9 at step 1 survives to step 2).
    assert [max(t.intermediate_values) for t in study.trials[3:]] == [2, 2]
    assert isinstance(make_pruner("halving", warmup_steps=20), optuna.pruners.SuccessiveHalvingPruner)
    with pytest.raises(RecipeError):
        make_pruner("hyper")
