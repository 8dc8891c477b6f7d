"""Source lookup: from a profiler stack frame to the `file:line` in the user's code that issued an op.

The profiler's Python stacks name the *function* an op ran in (the python tracer records a frame's
first line, not the current one), so the line inside that function is found by reading its source
for the construct that issues the op (`.item()`, `x[mask]`, the `for` over the loader,
`optimizer.step()`)."""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .frames import is_user_file, parse_frame


def caller_frame(stack: Sequence[str]) -> tuple[str, int, str] | None:
    """The frame that called the op: skips builtin-method and nn.Module entries."""
    for entry in stack:
        frame = parse_frame(entry)
        if frame is not None:
            return frame
    return None


def user_frame(stack: Sequence[str], own: bool) -> tuple[str, int, str] | None:
    for entry in stack:
        frame = parse_frame(entry)
        if frame is not None and is_user_file(frame[0], own):
            return frame
    return None


# ----------------------------------------------------------------------------- source lines


@functools.lru_cache(maxsize=64)
def parse_source(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def scope_of(tree: ast.Module, line: int, func: str) -> ast.AST:
    """The function the profiler named (innermost def called `func` around `line`), else the module."""
    if func == "<module>":
        return tree
    best: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= (node.end_lineno or node.lineno):
                if best is tree or node.lineno > getattr(best, "lineno", 0):
                    best = node
    return best


def walk_scope(scope: ast.AST) -> Iterable[tuple[ast.AST, int]]:
    """Nodes of this scope (not of nested defs, classes or lambdas), with their loop depth."""
    stack: list[tuple[ast.AST, int]] = [(scope, 0)]
    while stack:
        node, depth = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                continue
            inner = depth + isinstance(child, ast.For | ast.While | ast.AsyncFor)
            yield child, inner
            stack.append((child, inner))


def attr_call(node: ast.AST, names: Iterable[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in set(names)


def is_tensor_index(node: ast.AST) -> bool:
    """x[expr] where expr is not a constant, a slice, or a tuple of those (a mask or index tensor)."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.ctx, ast.Load):
        return False
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]

    def static(p: ast.AST) -> bool:
        if isinstance(p, ast.Constant | ast.Slice):
            return True
        if isinstance(p, ast.UnaryOp):
            return static(p.operand)
        return False

    return not all(static(p) for p in parts)


def contains_call(node: ast.AST, names: Iterable[str]) -> bool:
    return any(attr_call(n, names) for n in ast.walk(node))


MATCHERS: dict[str, Callable[[ast.AST], bool]] = {
    "item": lambda n: attr_call(n, ("item",)),
    "to_host": lambda n: attr_call(n, ("cpu", "tolist", "numpy")),
    "nonzero": lambda n: attr_call(n, ("nonzero", "argwhere", "where", "unique")),
    "bool_mask": lambda n: is_tensor_index(n) or attr_call(n, ("masked_select",)),
    "loop": lambda n: isinstance(n, ast.For | ast.AsyncFor) or attr_call(n, ("next",)),
    "optimizer_step": lambda n: attr_call(n, ("step",)),
    "copy": lambda n: attr_call(n, ("to", "cuda", "copy_")),
}


def locate(frame: tuple[str, int, str], hint: str | None) -> tuple[str, list[int]]:
    """`file:line` for an op issued in `frame` by the construct `hint`, plus every candidate line.

    Candidates inside a loop come first (a step's work is in the loop); for `loop`, the `for`
    whose body steps the optimizer or calls backward wins."""
    path, line, func = frame
    tree = parse_source(path) if hint else None
    if tree is None or hint not in MATCHERS:
        return f"{path}:{line}", [line]
    scope = scope_of(tree, line, func)
    hits = [(node, depth) for node, depth in walk_scope(scope) if MATCHERS[hint](node)]
    if not hits:
        return f"{path}:{line}", [line]
    if hint == "loop":
        steppers = [h for h in hits if contains_call(h[0], ("step", "backward", "mark_step"))]
        hits = steppers or hits
        hits.sort(key=lambda h: (-h[1], h[0].lineno))  # innermost stepping loop
    else:
        hits.sort(key=lambda h: (h[1] == 0, h[0].lineno))
    lines = sorted({h[0].lineno for h in hits})
    return f"{path}:{hits[0][0].lineno}", lines


def relative(where: str | None, base: str | None = None) -> str | None:
    """`where` relative to `base` (default: the working directory) when it lies below it."""
    if where is None:
        return None
    base = base or os.getcwd()
    path, _, line = where.rpartition(":")
    try:
        return f"{os.path.relpath(path, base)}:{line}" if path.startswith(base) else where
    except ValueError:
        return where
