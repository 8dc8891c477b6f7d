"""Serving's commands: `slipstream serve` (server_cli.py), `slipstream loadtest` (loadtest_cli.py)
and `slipstream quantize-eval` (quantize_cli.py), one module each.

`add_parser(subparsers)` registers them on the top-level CLI; `main(argv)` runs them standalone
(`python -m slipstream.serve.cli serve ...`). Bad input raises RecipeError (one line, exit 2).
"""

from __future__ import annotations

import argparse
import sys

from ..commands import check_output_paths
from . import loadtest_cli, quantize_cli, server_cli


def add_parser(subparsers) -> None:
    server_cli.add_parser(subparsers)
    loadtest_cli.add_parser(subparsers)
    quantize_cli.add_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    from ..checkpoint import CheckpointError
    from ..recipe import RecipeError

    parser = argparse.ArgumentParser(prog="slipstream")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        check_output_paths(args)
        return args.fn(args)
    except (RecipeError, CheckpointError) as err:
        print(f"slipstream {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slipstream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
