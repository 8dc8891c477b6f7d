"""Python stack frames as the profiler records them: parsed, resolved to files, and sorted into
the user's code vs torch's, the standard library's and slipstream's own."""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- user frames

FRAME_PATTERN = re.compile(r"^(?P<path>.*)\((?P<line>\d+)\): (?P<func>.*)$")
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OWN_DIR = str(Path(__file__).resolve().parents[1])
_STDLIB_DIRS = tuple(
    {str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])}
)


def parse_frame(entry: str) -> tuple[str, int, str] | None:
    """`path(line): function` -> (path, line, function); None for builtins and module markers."""
    m = FRAME_PATTERN.match(entry)
    if m is None or entry.startswith("<"):
        return None
    return m.group("path"), int(m.group("line")), m.group("func")


def is_user_file(path: str, own_code_is_user: bool = False) -> bool:
    """User code: not torch, not the standard library, not slipstream (unless profiling its own loop)."""
    if not path or path.startswith("<"):
        return False
    p = str(Path(path).resolve()) if os.path.isabs(path) else path
    if p.startswith(_TORCH_DIR + os.sep) or p.startswith(("torch/", "torch\\")):
        return False
    if not own_code_is_user and (p.startswith(_OWN_DIR + os.sep) or p.startswith("slipstream/")):
        return False
    if os.path.isabs(p) and p.startswith(_STDLIB_DIRS) and "site-packages" not in p:
        return False
    return os.path.isabs(p)  # unresolved relative names are library files the profiler shortened


def resolve_path(path: str, search: Sequence[str]) -> str:
    """The profiler shortens paths relative to sys.path entries; find the file they name."""
    if os.path.isabs(path):
        return path
    for base in search:
        candidate = os.path.join(base or os.getcwd(), path)
        if os.path.isfile(candidate):
            return str(Path(candidate).resolve())
    return path


def resolve_stack(stack: Sequence[str], cache: dict[str, str], search: Sequence[str]) -> tuple[str, ...]:
    out = []
    for entry in stack:
        frame = parse_frame(entry)
        if frame is None:
            out.append(entry)
            continue
        path, line, func = frame
        if path not in cache:
            cache[path] = resolve_path(path, search)
        out.append(f"{cache[path]}({line}): {func}")
    return tuple(out)


def innermost_user_frame(
    frames: Sequence[traceback.FrameSummary], own_code_is_user: bool = False
) -> tuple[str, int, str] | None:
    for fs in reversed(frames):
        if is_user_file(fs.filename, own_code_is_user):
            return str(Path(fs.filename).resolve()), int(fs.lineno or 0), fs.name
    return None
