"""`slipstream optimize`: argument parsing and printing; the search lives in search.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ..commands import add_command, add_workload_arguments, progress_printer, workload_flags
from ..files import write_json
from ..recipe import RecipeError

EXAMPLES = """examples:
  slipstream optimize --workload gpt-stdlib --size small --budget 5m
  slipstream optimize --size small --budget 10m --base baseline+shapes.max_len=512 --out runs/opt
  slipstream optimize --size tiny --budget 2m --stages shapes,precision,kernels,compile --json opt.json
"""


def parse_budget(text: str) -> float:
    """'300', '300s', '5m', '1h', '1m30s' -> seconds."""
    m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or m is None or not any(m.groups()):
        raise RecipeError(f"--budget {text!r}: use seconds or a duration such as 300, 90s, 5m, 1h")
    h, mi, sec = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + sec


def cmd_optimize(args: argparse.Namespace) -> int:
    from .report import markdown, write_outputs
    from .search import optimize

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    budget = parse_budget(args.budget)
    with progress_printer("optimize") as say:
        result = optimize(
            args.workload,
            base=args.base,
            size=args.size,
            budget_s=budget,
            stages=stages,
            rounds=args.rounds,
            round_tokens=args.round_tokens,
            noise_seeds=args.noise_seeds,
            parity_steps=args.parity_steps,
            progress=say,
        )
    payload: dict[str, Any] = result.to_dict()
    paths = write_outputs(payload, Path(args.out))
    write_json(args.json, payload)
    print(markdown(payload))
    print(f"recipe: {paths['recipe']}  report: {paths['html']} (and .md, .json)")
    print(
        f"train with it: slipstream train {workload_flags(args.workload, args.size)} --recipe {paths['recipe']}"
    )
    return 0


def add_parser(subparsers: Any) -> None:
    from .search import DEFAULT_STAGES, STAGES

    p = add_command(
        subparsers,
        "optimize",
        "find the fastest recipe for a workload on this machine by measurement, kept only at loss parity",
        EXAMPLES,
    )
    add_workload_arguments(p)
    p.add_argument(
        "--base", default="baseline", help="starting recipe and parity reference (default: baseline)"
    )
    p.add_argument("--budget", default="5m", help="time budget: 300, 90s, 5m, 1h (default: 5m)")
    p.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"stages in order, from: {', '.join(STAGES)} (default: all)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per stage (default: 3)")
    p.add_argument(
        "--round-tokens", type=int, help="real tokens per contender per round (default: 2 batches)"
    )
    p.add_argument(
        "--noise-seeds", type=int, default=2, help="reference re-runs for the parity band (default: 2)"
    )
    p.add_argument(
        "--parity-steps",
        type=int,
        help="optimizer steps every stage's reference trains before parity is judged, in extra rounds "
        "(default: 100); 0: only --rounds, and no change is kept on a shorter run",
    )
    p.add_argument("--out", default="optimize-out", help="folder for recipe.toml and the reports")
    p.add_argument("--json", help="also write the JSON result here")
    p.set_defaults(fn=cmd_optimize)
