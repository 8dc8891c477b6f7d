"""`slipstream tune` and `slipstream lr-find`: argument parsing and printing; the work is in the package.

`add_parser(subparsers)` registers both commands on the top-level CLI; `python -m slipstream.tune.cli`
runs them on their own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..commands import add_command, add_workload_arguments, run_command
from ..files import write_json
from ..presets import resolve_recipe
from ..recipe import RecipeError

TUNE_EXAMPLES = """examples:
  slipstream tune --workload gpt-stdlib --size tiny --param lr=1e-4:1e-2:log --trials 20 --method auto --json out.json
  slipstream tune --param lr=3e-4:3e-2:log --param warmup=0:40 --trials 15 --steps 120 --eval-every 20
  slipstream tune --param lr=1e-4:1e-2:log --param schedule=constant,cosine,one-cycle --method bayesian
  slipstream tune --objective branin --trials 50 --method auto          # a synthetic function, seconds
  # several workers, one study (run the same line in each terminal or machine):
  slipstream tune --study lr-sweep --storage postgresql://user:pw@db/optuna --param lr=1e-4:1e-2:log --trials 40
  # stopped half-way? the same command again continues from the stored trials
"""

LR_FIND_EXAMPLES = """examples:
  slipstream lr-find --workload gpt-stdlib --size tiny --plot lr.png
  slipstream lr-find --recipe baseline --set shapes.max_len=256 --start-lr 1e-6 --end-lr 1 --steps 100 --json lr.json
"""


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def cmd_tune(args: argparse.Namespace) -> int:
    from .objectives import SYNTHETIC, WorkloadObjective
    from .search import make_pruner, run_study, summarize
    from .space import apply_params, base_params, parse_param
    from .storage import open_storage, redact, storage_url

    if args.trials < 1:
        raise RecipeError(f"--trials {args.trials}: must be at least 1")
    recipe = None
    enqueue = None
    if args.objective:
        if args.objective not in SYNTHETIC:
            raise RecipeError(f"--objective {args.objective!r}; choose one of {', '.join(SYNTHETIC)}")
        if args.param:
            raise RecipeError("--objective functions have their own parameters; drop --param")
        synth = SYNTHETIC[args.objective]
        space, objective, what = list(synth.space), synth, args.objective
        default_name = f"tune-{args.objective}"
    else:
        if not args.param:
            raise RecipeError("give at least one --param NAME=LOW:HIGH[:log] (e.g. --param lr=1e-4:1e-2:log)")
        if args.steps < 1 or args.eval_every < 1:
            raise RecipeError("--steps and --eval-every must be at least 1")
        recipe = resolve_recipe(args.recipe, args.set)
        space = [parse_param(p) for p in args.param]
        if len({p.name for p in space}) != len(space):
            raise RecipeError("each --param may appear once")
        objective = WorkloadObjective(
            args.workload, args.size, recipe, space, args.steps, args.eval_every, args.eval_batches
        )
        what = f"{args.workload} ({args.size}) validation loss after {args.steps} steps"
        from ..workloads import workload_slug

        default_name = f"tune-{workload_slug(args.workload)}-{args.size}"
        if not args.no_base:
            enqueue = base_params(recipe, space)
    study_name = args.study or default_name
    run_dir = Path(args.run_dir or Path("runs") / "tune" / study_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(args.storage, run_dir, heartbeat_interval=args.heartbeat)
    warmup = args.prune_warmup if args.prune_warmup is not None else max(args.eval_every, args.steps // 2)
    # Synthetic functions report no intermediate values: nothing to prune.
    pruner = None if args.objective else make_pruner(args.pruner, warmup_steps=warmup)

    print(f"study {study_name!r} in {redact(storage_url(args.storage, run_dir))}")
    print(f"minimising {what} over: " + "; ".join(p.describe() for p in space))

    def on_trial(study: Any, trial: Any) -> None:
        best = None
        try:
            best = study.best_trial
        except ValueError:
            pass
        params = " ".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in trial.params.items())
        value = _fmt(trial.value) if trial.value is not None else "-"
        if trial.state.name == "PRUNED" and trial.intermediate_values:
            step, last = max(trial.intermediate_values.items())
            value = f"{_fmt(last)} @ step {step}"
        best_s = f"best {_fmt(best.value)} (#{best.number})" if best is not None else "best -"
        dur = f"{trial.duration.total_seconds():.1f} s" if trial.duration else ""
        print(
            f"trial {trial.number:3d} {trial.state.name:8} {value:>18}  {params}  · {best_s} · {dur}",
            flush=True,
        )

    study, choice = run_study(
        objective,
        space,
        study_name=study_name,
        storage=storage,
        n_trials=args.trials,
        method=args.method,
        seed=args.seed,
        pruner=pruner,
        enqueue=enqueue,
        on_trial=on_trial,
    )
    print(f"method: {choice.method} ({choice.reason})")
    summary = summarize(study, choice, storage_url(args.storage, run_dir))
    best = summary["best"]
    if best is not None and recipe is not None:
        from ..recipe import save_recipe

        tuned = apply_params(recipe, best["params"], name=f"{study_name}-best")
        best["recipe_path"] = str(save_recipe(tuned, run_dir / "best.toml"))
    summary["plots"] = [] if args.no_plots else _plots(study, run_dir)
    write_json(run_dir / "result.json", summary)
    write_json(args.json, summary)
    states = ", ".join(f"{n} {s.lower()}" for s, n in summary["states"].items() if n)
    print(f"{len(summary['trials'])} trials ({states})")
    if best is None:
        print("no trial completed")
        return 1
    params = " ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items())
    print(f"best: {_fmt(best['value'])} (trial {best['number']}: {params})")
    if summary["base"] is not None:
        print(f"base recipe: {_fmt(summary['base']['value'])} ({args.recipe})")
    if "fibonacci" in summary:
        fib = summary["fibonacci"]
        print(
            f"fibonacci bracket: [{_fmt(fib['low'])}, {_fmt(fib['high'])}], width {fib['width_ratio']:.3g} of the range "
            f"(bound {fib['bound_ratio']:.3g})"
            + (f"; fell back: {fib['fallback']}" if fib["fallback"] else "")
        )
    if best["recipe_path"]:
        print(f"wrote {best['recipe_path']}  (slipstream train --recipe {best['recipe_path']})")
    for p in summary["plots"]:
        print(f"wrote {p}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _plots(study: Any, run_dir: Path) -> list[str]:
    from .plots import write_plots

    return write_plots(study, run_dir)


def cmd_lr_find(args: argparse.Namespace) -> int:
    from .lr_finder import lr_find_workload, plot_lr_find

    recipe = resolve_recipe(args.recipe, args.set)
    result = lr_find_workload(
        args.workload,
        recipe,
        size=args.size,
        start_lr=args.start_lr,
        end_lr=args.end_lr,
        num_steps=args.steps,
    )
    payload = {"workload": args.workload, "size": args.size, "recipe": recipe.to_dict(), **result.to_dict()}
    if args.plot:
        payload["plot"] = str(plot_lr_find(result, args.plot))
    write_json(args.json, payload)
    print(
        f"swept {len(result.lrs)} steps from {result.lrs[0]:.2e} to {result.lrs[-1]:.2e} ({result.stop_reason})"
    )
    print(f"minimum smoothed loss {min(result.smoothed):.4f} at lr {result.min_loss_lr:.2e}")
    if result.steepest_lr is not None:
        print(f"steepest fall at lr {result.steepest_lr:.2e}")
    print(f"suggested lr: {result.suggested_lr:.2e} (rule: {result.rule})")
    print(f"try: slipstream train --recipe {args.recipe} --set optimizer.lr={result.suggested_lr:.3g}")
    for key in ("plot",):
        if key in payload:
            print(f"wrote {payload[key]}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `tune` and `lr-find` on an argparse subparsers object."""
    from .search import METHODS, PRUNERS

    def add(name: str, help_: str, epilog: str) -> argparse.ArgumentParser:
        return add_command(subparsers, name, help_, epilog)

    p = add(
        "tune",
        "search recipe fields (learning rate, warm-up, ...) with Optuna: Fibonacci, evolutionary, Bayesian or random",
        TUNE_EXAMPLES,
    )
    add_workload_arguments(p)
    p.add_argument(
        "--recipe", default="baseline", help="base recipe: preset, file, or preset+section.field=value"
    )
    p.add_argument(
        "--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one base-recipe field"
    )
    p.add_argument(
        "--param",
        action="append",
        metavar="NAME=LOW:HIGH[:log][:int] | NAME=A,B,C",
        help="a searched recipe field (lr, warmup, wd, schedule or section.field); repeat for more",
    )
    p.add_argument(
        "--objective",
        help="tune a synthetic test function instead: branin, hartmann6, rosenbrock4, quadratic, lr-valley",
    )
    p.add_argument(
        "--trials", type=int, default=20, help="finished trials the study should hold (default: 20)"
    )
    p.add_argument(
        "--method",
        default="auto",
        choices=METHODS,
        help="search method (default: auto, which says what it picked)",
    )
    p.add_argument(
        "--pruner", default="median", choices=PRUNERS, help="stop bad trials early (default: median)"
    )
    p.add_argument(
        "--prune-warmup", type=int, help="no pruning before this step (default: max(eval-every, steps/2))"
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per trial (default: 100)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=20,
        help="validation (and pruning check) every N steps (default: 20)",
    )
    p.add_argument(
        "--eval-batches", type=int, default=4, help="validation batches per evaluation (default: 4)"
    )
    p.add_argument(
        "--study", help="study name; reuse it to resume or to add workers (default: tune-WORKLOAD-SIZE)"
    )
    p.add_argument(
        "--storage",
        help="sqlite:///PATH, postgresql://USER@HOST/DB or PATH.journal (default: SQLite in the run folder)",
    )
    p.add_argument(
        "--run-dir", help="folder for the study, best.toml, plots and result.json (default: runs/tune/STUDY)"
    )
    p.add_argument(
        "--heartbeat",
        type=int,
        default=10,
        help="seconds between worker heartbeats (database storage; default: 10)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="sampler seed (default: a fresh one per worker); offset per worker and by the stored trials",
    )
    p.add_argument("--no-base", action="store_true", help="do not run the base recipe as the first trial")
    p.add_argument(
        "--no-plots", action="store_true", help="skip the optimisation-history and importance plots"
    )
    p.add_argument("--json", help="write trials and best (params, value, recipe path) to this file")
    p.set_defaults(fn=cmd_tune, on_interrupt="the study keeps its trials; run again to resume")

    p = add(
        "lr-find",
        "learning-rate range test: exponential sweep, smoothed loss, a suggested learning rate",
        LR_FIND_EXAMPLES,
    )
    add_workload_arguments(p)
    p.add_argument("--recipe", default="baseline", help="preset, file, or preset+section.field=value")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one recipe field")
    p.add_argument("--start-lr", type=float, default=1e-6, help="first learning rate (default: 1e-6)")
    p.add_argument("--end-lr", type=float, default=1.0, help="last learning rate (default: 1)")
    p.add_argument("--steps", type=int, default=100, help="steps in the sweep (default: 100)")
    p.add_argument("--plot", help="write the loss-vs-learning-rate plot to this PNG")
    p.add_argument("--json", help="write the sweep and the suggestion to this file")
    p.set_defaults(fn=cmd_lr_find)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream", description="slipstream tuning commands")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
