"""Tuning benchmarks (issue 7). Each part prints a table and writes JSON with machine info.

    python benchmarks/tune.py fibonacci [--seeds 20]     evaluations to locate a 1-D minimiser within
                                                         1e-3 of the interval: Fibonacci vs random vs TPE
    python benchmarks/tune.py synthetic [--seeds 10]     best value after 50 trials on Branin, Hartmann6,
                                                         Rosenbrock-4D: auto vs random vs Optuna's default (TPE)
    python benchmarks/tune.py gpt RESULT.json            wrap a `slipstream tune` JSON (real run) with
                                                         machine info and the default recipe's loss

Medians over seeds; spreads as the 25th-75th percentiles.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import optuna

from slipstream.files import write_json  # noqa: E402
from slipstream.tune.fibonacci import FibonacciSampler, fibonacci_numbers
from slipstream.tune.objectives import SYNTHETIC, lr_valley
from slipstream.tune.search import choose_method

optuna.logging.set_verbosity(optuna.logging.WARNING)
RESULTS = Path(__file__).resolve().parent / "results"
TAG = "cpu-2core"


def machine() -> dict:
    from slipstream.doctor import machine_info

    return {**machine_info(), "optuna": optuna.__version__}


def _write(name: str, payload: dict) -> Path:
    path = RESULTS / f"tune-{name}-{TAG}-{dt.date.today().isoformat()}.json"
    write_json(path, payload)
    print(f"wrote {path}")
    return path


def _q(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    return {
        "median": float(np.median(a)),
        "p25": float(np.percentile(a, 25)),
        "p75": float(np.percentile(a, 75)),
    }


# ----------------------------------------------------------------------------- 1-D: Fibonacci


def _evals_to_locate(sampler, f, dist, coord, target_c, tol, cap) -> int | None:
    """Evaluations until some evaluated point lies within `tol` (search coordinates) of the minimiser."""
    study = optuna.create_study(sampler=sampler)
    for i in range(1, cap + 1):
        trial = study.ask({"x": dist})
        x = trial.params["x"]
        study.tell(trial, f(x))
        if abs(coord(x) - target_c) <= tol:
            return i
    return None


def part_fibonacci(seeds: int) -> dict:
    tol_frac = 1e-3
    n_fib = next(n for n in range(1, 40) if (1.01) / fibonacci_numbers(n)[n] <= tol_frac)
    caps = {"fibonacci": n_fib, "random": 5000, "tpe": 400}
    problems = {
        "shifted quadratic on [0, 1]": dict(
            dist=optuna.distributions.FloatDistribution(0.0, 1.0),
            coord=lambda x: x,
            width=1.0,
            draw=lambda rng: rng.uniform(0.05, 0.95),
            to_c=lambda t: t,
        ),
        "lr valley on [1e-6, 1] (log)": dict(
            dist=optuna.distributions.FloatDistribution(1e-6, 1.0, log=True),
            coord=lambda x: math.log(x),
            width=math.log(1e6),
            draw=lambda rng: 10 ** rng.uniform(-5, -1),
            to_c=lambda t: math.log(t),
        ),
    }
    out: dict = {
        "tolerance": "1e-3 of the interval (log interval for the lr valley)",
        "fibonacci_N": n_fib,
        "caps": caps,
        "seeds": seeds,
        "problems": {},
    }
    print(
        f"Fibonacci with N={n_fib} (bracket (1+0.01)/F_N = {1.01 / fibonacci_numbers(n_fib)[n_fib]:.2e} of the interval)"
    )
    for pname, spec in problems.items():
        rows = {m: [] for m in caps}
        t0 = time.perf_counter()
        for seed in range(seeds):
            rng = np.random.default_rng(1000 + seed)
            target = spec["draw"](rng)
            if pname.startswith("lr"):
                g = lr_valley(target)
                f = lambda x, g=g: g({"lr": x})  # noqa: E731
            else:
                f = lambda x, t=target: (x - t) ** 2  # noqa: E731
            tc, tol = spec["to_c"](target), tol_frac * spec["width"]
            samplers = {
                "fibonacci": FibonacciSampler(n_fib),
                "random": optuna.samplers.RandomSampler(seed=seed),
                "tpe": optuna.samplers.TPESampler(seed=seed),
            }
            for m, s in samplers.items():
                rows[m].append(_evals_to_locate(s, f, spec["dist"], spec["coord"], tc, tol, caps[m]))
        res = {}
        for m, vals in rows.items():
            found = [v for v in vals if v is not None]
            # A run that never got there counts as "more than the cap" (median still defined if < half).
            filled = [v if v is not None else math.inf for v in vals]
            res[m] = {
                "evaluations_median": float(np.median(filled)),
                "evaluations_p25": float(np.percentile(filled, 25)),
                "evaluations_p75": float(np.percentile(filled, 75)),
                "located": f"{len(found)}/{len(vals)}",
                "per_seed": vals,
            }
        out["problems"][pname] = res
        print(f"\n{pname}  ({time.perf_counter() - t0:.0f} s)")
        print(f"  {'method':10} {'median evals':>12} {'p25-p75':>14} {'located':>8}")
        for m, r in res.items():
            print(
                f"  {m:10} {r['evaluations_median']:12.0f} {r['evaluations_p25']:6.0f}-{r['evaluations_p75']:<7.0f} {r['located']:>8}"
            )
    return out


# ----------------------------------------------------------------------------- synthetic n-D


def part_synthetic(seeds: int, trials: int, functions: list[str]) -> dict:
    out: dict = {"trials": trials, "seeds": seeds, "functions": {}}
    for fname in functions:
        fn = SYNTHETIC[fname]
        res = {}
        for label in ("auto", "random", "default"):
            bests, secs, picked = [], [], None
            for seed in range(seeds):
                if label == "auto":
                    choice = choose_method("auto", list(fn.space), trials, seed=seed)
                    sampler, picked = choice.sampler, choice.method
                elif label == "random":
                    sampler = optuna.samplers.RandomSampler(seed=seed)
                else:
                    sampler = optuna.samplers.TPESampler(seed=seed)  # what create_study() uses
                study = optuna.create_study(sampler=sampler)
                t0 = time.perf_counter()
                study.optimize(fn, n_trials=trials)
                secs.append(time.perf_counter() - t0)
                bests.append(study.best_value)
            res[label] = {
                "sampler": picked or ("random" if label == "random" else "tpe (Optuna default)"),
                "best": _q(bests),
                "regret": _q([b - fn.minimum for b in bests]),
                "per_seed": bests,
                "seconds_per_run": statistics.median(secs),
            }
        out["functions"][fname] = {"minimum": fn.minimum, "methods": res}
        print(
            f"\n{fname} (global minimum {fn.minimum:g}), best after {trials} trials, median over {seeds} seeds"
        )
        print(f"  {'method':10} {'sampler':22} {'best':>10} {'p25-p75':>22} {'s/run':>7}")
        for label, r in res.items():
            b = r["best"]
            print(
                f"  {label:10} {r['sampler']:22} {b['median']:10.4f} {b['p25']:10.4f}-{b['p75']:<10.4f} {r['seconds_per_run']:7.1f}"
            )
        sys.stdout.flush()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("fibonacci", "synthetic", "gpt"))
    ap.add_argument("result", nargs="?", help="gpt: the `slipstream tune --json` file")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--functions", default="branin,hartmann6,rosenbrock4")
    ap.add_argument(
        "--default-loss", type=float, help="gpt: the default recipe's validation loss, if measured apart"
    )
    args = ap.parse_args()
    info = machine()
    if args.part == "fibonacci":
        _write("fibonacci", {"machine": info, **part_fibonacci(args.seeds or 20)})
    elif args.part == "synthetic":
        data = part_synthetic(args.seeds or 10, args.trials, args.functions.split(","))
        _write("synthetic", {"machine": info, **data})
    else:
        run = json.loads(Path(args.result).read_text())
        best, base = run["best"], run["base"]
        summary = {
            "best_val_loss": best["value"],
            "best_params": best["params"],
            "default_recipe_val_loss": base["value"] if base else args.default_loss,
            "default_measured_apart": args.default_loss,
            "trials": len(run["trials"]),
            "states": run["states"],
            "method": run["method"],
            "method_reason": run["method_reason"],
        }
        print(json.dumps(summary, indent=2))
        _write("gpt-tiny", {"machine": info, "summary": summary, "run": run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
