"""`slipstream profile`: argument parsing and printing only (the work is in capture/analyze)."""

from __future__ import annotations

import argparse
import sys

from ..commands import add_command, add_workload_arguments, run_command

DESCRIPTION = (
    "profile a few training steps (the built-in loop, or your script after `--`) and report where the "
    "step's time goes, at which line, and the fix"
)
EPILOG = """examples:
  slipstream profile --workload gpt-stdlib --recipe baseline --json p.json --trace t.json
  slipstream profile --recipe baseline+precision.dtype=bf16 --size small --light
  slipstream profile --model mymodels:build --data corpus.jsonl --tokenizer tok/
  slipstream profile --json p.json -- python train.py --epochs 1
  slipstream profile --wait 1 --active 5 -- python -m mypkg.train

Steps are closed by the first optimizer's step() (or by slipstream.mark_step() when the script
calls it). Open the trace in https://ui.perfetto.dev. The JSON schema is in docs/profile.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument(
        "--recipe", default="baseline", help="preset, .toml/.json file, or preset+section.field=value"
    )
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one recipe field")
    p.add_argument("--json", help="write the profile (findings, breakdown, overhead) to this file")
    p.add_argument("--trace", help="write the profiled steps as a Chrome/Perfetto trace to this file")
    p.add_argument("--wait", type=int, default=3, help="unprofiled steps first (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="profiler warm-up steps, discarded (default: 1)")
    p.add_argument("--active", type=int, default=3, help="profiled steps (default: 3)")
    p.add_argument(
        "--tail", type=int, default=3, help="unprofiled steps after, for the overhead (default: 3)"
    )
    p.add_argument(
        "--light", action="store_true", help="no Python stacks or shapes: less overhead, no `where`"
    )
    p.add_argument(
        "--run-to-end",
        action="store_true",
        help="scripts: let the script finish instead of stopping it after the profiled steps",
    )
    p.add_argument(
        "script_command",  # not `command`: the top-level parser keeps the subcommand's name there
        metavar="-- COMMAND",
        nargs=argparse.REMAINDER,
        help="after `--`: the script to profile instead, e.g. `-- python train.py args`",
    )


def handler(args: argparse.Namespace) -> int:
    from ..presets import resolve_recipe
    from ..recipe import RecipeError
    from . import analyze, capture_script, capture_workload
    from .records import CaptureConfig
    from .report import render, write_profile

    command = list(args.script_command or [])
    if command and command[0] == "--":
        command = command[1:]
    if command and command[0].startswith("-") and command[0] != "-m":
        raise RecipeError(f"unknown option {command[0]!r}; put the script after `--`: -- python script.py")
    cfg = CaptureConfig(
        wait=args.wait,
        warmup=args.warmup,
        active=args.active,
        tail=args.tail,
        light=args.light,
        trace_path=args.trace,
        stop_when_done=not args.run_to_end,
    )
    if command:
        cap = capture_script(command, config=cfg)
    else:
        recipe = resolve_recipe(args.recipe, args.set)
        cap = capture_workload(args.workload, recipe, size=args.size, config=cfg)
    result = analyze(cap)
    render(result)
    if args.json:
        print(f"wrote {write_profile(result, args.json)}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `profile` on the top-level CLI's subparsers."""
    p = add_command(subparsers, "profile", DESCRIPTION, EPILOG)
    add_arguments(p)
    p.set_defaults(fn=handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream profile",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(fn=handler, command="profile")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
