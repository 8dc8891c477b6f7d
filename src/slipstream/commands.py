"""What every subcommand's parser shares: registration with examples, the workload flags and
their resolution, pastable workload flags, and the progress printer.

Subcommands defined in components (`serve/cli.py`, `tune/cli.py`, `profile/cli.py`,
`optimize/cli.py`) import these from here, and `cli.py` imports the components: the dependency
runs one way.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

from .recipe import RecipeError


def add_command(subparsers, name: str, help_: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows its description and examples verbatim."""
    return subparsers.add_parser(
        name,
        help=help_,
        description=help_,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """--workload/--size, or the user's own --model/--data/--tokenizer: every command that trains
    takes the same flags; resolve_workload() turns them into one workload name."""
    g = p.add_argument_group("workload (default: the built-in gpt-stdlib; see docs/own-model.md)")
    g.add_argument("--workload", default=DEFAULT_WORKLOAD, help="registered workload (default: gpt-stdlib)")
    g.add_argument(
        "--size",
        default=DEFAULT_SIZE,
        help="built-in GPT size: tiny, small, gpt2-124m (default: tiny; `custom` with --model)",
    )
    g.add_argument("--model", metavar="MODULE:FACTORY", help="your model: FACTORY() returns an nn.Module")
    g.add_argument("--data", metavar="PATH", help="your text: .txt, .jsonl, a folder, or a datasets folder")
    g.add_argument(
        "--tokenizer", metavar="PATH", help="a local Hugging Face tokenizer folder (default: bytes)"
    )
    g.add_argument(
        "--text-field", default="text", help="JSONL field / dataset column of the text (default: text)"
    )


DEFAULT_WORKLOAD, DEFAULT_SIZE = "gpt-stdlib", "tiny"


def resolve_workload(args: argparse.Namespace) -> None:
    """Set args.workload and args.size from the workload flags (a `user:...` name when any of
    --model/--data/--tokenizer is given, so subprocesses get the same workload by name). The
    defaults are real values, so a handler reached without this call still runs gpt-stdlib."""
    if not hasattr(args, "text_field"):
        return  # a command without workload flags
    from .workloads.user import CUSTOM_SIZE, PREFIX, user_workload_name

    if any(getattr(args, k) for k in ("model", "data", "tokenizer")):
        if args.workload != DEFAULT_WORKLOAD:
            raise RecipeError(
                "--workload names a built-in workload; drop it when passing --model/--data/--tokenizer"
            )
        if args.model and args.size not in (DEFAULT_SIZE, CUSTOM_SIZE):
            raise RecipeError(f"--size {args.size} sizes the built-in GPT; your --model decides its own size")
        args.workload = user_workload_name(args.model, args.data, args.tokenizer, args.text_field)
        args.size = CUSTOM_SIZE if args.model else args.size
    elif args.workload.startswith(PREFIX) and "model=" in args.workload and args.size == DEFAULT_SIZE:
        args.size = CUSTOM_SIZE  # a pasted user:model=... name: its model has the one size


def check_limits(
    positive: dict[str, float | None], at_least_0: dict[str, float | None] | None = None
) -> None:
    """Refuse numeric flags out of range, by name ({flag: value}; None = not given). `not value > 0`
    rather than `value <= 0`, so that nan is refused too."""
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise RecipeError(f"{flag} {value} must be > 0")
    for flag, value in (at_least_0 or {}).items():
        if value is not None and not value >= 0:
            raise RecipeError(f"{flag} {value} must be >= 0")


OUTPUT_FILE_FLAGS = ("json", "report", "save", "trace", "plot")
"""Flags naming a file a command writes at its end: checked before the work starts."""


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse an output file that cannot be written (a folder, or under a file) before any work:
    otherwise a long run would end in a traceback with its result lost."""
    import os
    from pathlib import Path

    for flag in OUTPUT_FILE_FLAGS:
        value = getattr(args, flag, None)
        if not value or not isinstance(value, str):
            continue
        path = Path(value)
        if path.is_dir():
            raise RecipeError(f"--{flag} {value} is a folder; give a file path such as {path / 'out.json'}")
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise RecipeError(f"--{flag} {value}: {parent} is a file, not a folder; give another path")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise RecipeError(f"--{flag} {value}: cannot write in {parent}; give a path you can write to")


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command's handler (`args.fn`) as every entry point does (`slipstream`, and
    `python -m slipstream.{serve,tune,profile}.cli`): bad input, a refused path or a failed rank
    is one line on stderr and exit 2, Ctrl-C is exit 130 with the command's `on_interrupt` hint;
    anything else is a bug and keeps its traceback."""
    from .checkpoint import CheckpointError
    from .distributed.env import RankFailure
    from .workloads.corpus import CorpusError

    name = args.command
    try:
        resolve_workload(args)
        check_output_paths(args)
        return args.fn(args)
    except (RecipeError, CheckpointError, CorpusError, FloatingPointError, RankFailure) as err:
        print(f"slipstream {name}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:
            raise  # not about a file the user named: a bug, keep its traceback
        # A path the user gave that the OS refused (permissions, a read-only or missing mount)
        print(f"slipstream {name}: error: {err.filename}: {err.strerror}; check the path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = getattr(args, "on_interrupt", None)
        print(f"slipstream {name}: interrupted" + (f" ({hint})" if hint else ""), file=sys.stderr)
        return 130


def workload_flags(workload: str, size: str) -> str:
    """The command-line flags that select `workload` (for printed commands a user can paste)."""
    if not workload.startswith("user:"):
        return f"--workload {workload} --size {size}"
    from .workloads.user import parse_user_name

    spec = parse_user_name(workload)
    return " ".join(spec.flags() + ([] if spec.model else [f"--size {size}"]))


@contextlib.contextmanager
def progress_printer(label: str) -> Iterator[Callable[[str], None]]:
    """Yields `say(msg)`: a live status line on a terminal, plain time-stamped lines on stderr
    otherwise (logs, CI, `make demo | tee`)."""
    import time

    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        with console.status(label) as status:

            def say(msg: str) -> None:
                status.update(f"{label}: {msg}")
                if msg.startswith(("round", "skipping")):
                    console.print(f"  {msg}", highlight=False)

            yield say
        return
    t0 = time.perf_counter()

    def say_plain(msg: str) -> None:
        print(f"[{label} {time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    yield say_plain
