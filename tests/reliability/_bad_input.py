"""What every case of the bad-input catalogue (test_bad_*.py) checks: one line naming the fix, no
traceback, the user's files byte-identical. (A module of its own, not conftest.py: test files
import it, and `conftest` is a name several folders' conftest.py share.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FAST = "baseline+shapes.max_len=64+shapes.tokens_per_batch=256"
"""The recipe of the checkpoint every checkpoint case starts from (tiny GPT, 64-token rows)."""


@dataclass(frozen=True)
class Case:
    """One bad input: the command line (placeholders `{bad}`, `{ck}`, `{busy}` filled in by the
    fixtures), what the one-line message must contain (the problem and the fix), and the files
    that must come through byte-identical."""

    id: str
    argv: str
    needles: tuple[str, ...]
    keep: tuple[str, ...] = ()
    usage: bool = False
    """argparse refused it: its usage lines come first, then the one error line."""


def check_message(err: str, command: str, needles: tuple[str, ...], usage: bool = False) -> str:
    """stderr holds one error line (after argparse's usage lines, for argparse's own errors),
    no traceback, and every needle; returns the line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    line = lines[-1]
    if usage:
        assert lines[0].startswith("usage:"), err
    else:
        assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert line.startswith(f"slipstream {command}: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def snapshot(paths: list[Path]) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


def assert_unchanged(before: dict[Path, bytes]) -> None:
    for path, data in before.items():
        assert path.exists(), f"{path} was removed"
        assert path.read_bytes() == data, f"{path} was overwritten"
