"""Serving's commands: `slipstream serve` (server_cli.py), `slipstream loadtest` (loadtest_cli.py)
and `slipstream quantize-eval` (quantize_cli.py), one module each.

`add_parser(subparsers)` registers them on the top-level CLI; `main(argv)` runs them standalone
(`python -m slipstream.serve.cli serve ...`), both through `commands.run_command`: bad input
raises RecipeError (one line, exit 2).
"""

from __future__ import annotations

import argparse
import sys

from ..commands import run_command
from . import loadtest_cli, quantize_cli, server_cli


def add_parser(subparsers) -> None:
    server_cli.add_parser(subparsers)
    loadtest_cli.add_parser(subparsers)
    quantize_cli.add_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
