"""The house rules of src/slipstream, checked on every import statement (lazy ones included: an
import inside a function is still a dependency): no module cycles, and the training core never
reaches into the tools built on top of it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "slipstream"

# The core of a training step, and what it must not import.
CORE = ("session", "train", "shapes", "kernels")
TOOLS = ("bench", "profile", "tune", "serve", "optimize", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """slipstream modules `name` imports, resolved to files (a package means its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            # `from pkg import mod` depends on mod alone when mod is a module (the package is
            # imported first in any case); `from pkg import name` depends on the package.
            subs = [f"{root}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in known] if all(t in known for t in subs) else [root, *subs]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import slipstream.a.b.c` depends on the deepest module
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("slipstream"):
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_training_core_imports_no_tool():
    graph = _graph()
    bad = []
    for name, deps in graph.items():
        part = name.split(".")[1] if "." in name else ""
        if part not in CORE:
            continue
        for dep in deps:
            dep_part = dep.split(".")[1] if "." in dep else ""
            if dep_part in TOOLS:
                bad.append(f"{name} -> {dep}")
    assert bad == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
