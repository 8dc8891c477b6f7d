"""Analysis: stateless functions over a Capture that return findings and tables.

Each `find_*` analyzer reads the capture and returns a list of `Finding`; `time_breakdown`,
`op_table` and `overhead` return rows whose keys carry their units. `analyze` is the thin facade
that runs them all. Nothing here prints or plots (report.py does).

`where` is a `file:line` in the user's code: the profiler's Python stacks name the *function* an op
ran in (the python tracer records a frame's first line, not the current one), so the line inside
that function is found by reading its source for the construct that issues the op (`.item()`,
`x[mask]`, the `for` over the loader, `optimizer.step()`). Compilations carry exact call sites
(Python's own stack, taken in dynamo's compile-start callback).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .capture import Capture, Event, is_user_file, parse_frame

Severity = Literal["info", "warning", "critical"]
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}

SMALL_OP_US = 20.0
"""A host op shorter than this is dominated by dispatch/launch cost rather than work."""

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::convolution",
        "aten::mkldnn_convolution",
        "aten::cudnn_convolution",
    }
)
CUDA_SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)
MASK_PARENTS = frozenset(
    {
        "aten::index",
        "aten::masked_select",
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::nonzero_numpy",
    }
)
TO_HOST = re.compile(r"^<built-in method (cpu|tolist|numpy) of Tensor")


@dataclass
class Finding:
    kind: Literal[
        "host_sync",
        "data_starvation",
        "recompile",
        "launch_bound",
        "padding_waste",
        "fp32_matmul",
        "unpinned_copy",
        "optimizer_not_fused",
    ]
    severity: Severity
    share_of_step: float
    """Estimated fraction of step time the problem accounts for (time spent in the ops it names)."""
    where: str | None
    """`file:line` in the user's code, or None when the problem is not at one line (recipe-level)."""
    fix: str
    """The recipe change or code change that removes it."""
    title: str
    detail: str = ""
    count_per_step: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    """Figures behind the finding, units in the keys."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- shared helpers


def _steps(cap: Capture) -> int:
    return max(1, len(cap.step_windows_us))


def _active_us(cap: Capture) -> float:
    return sum(b - a for a, b in cap.step_windows_us) or 1.0


def _in_steps(cap: Capture, ev: Event) -> bool:
    if not cap.step_windows_us:
        return False
    return cap.step_windows_us[0][0] <= ev.start_us <= cap.step_windows_us[-1][1]


def _active_events(cap: Capture) -> list[tuple[int, Event]]:
    return [(i, e) for i, e in enumerate(cap.events) if _in_steps(cap, e)]


def _severity(share: float, warn: float, critical: float, info: float = 0.0) -> Severity | None:
    if share >= critical:
        return "critical"
    if share >= warn:
        return "warning"
    if share >= info:
        return "info"
    return None


def stack_of(cap: Capture, i: int) -> tuple[str, ...]:
    """An event's Python stack (innermost first): its own, or its Python parents' names."""
    ev = cap.events[i]
    if ev.stack:
        return ev.stack
    out = [ev.name] if ev.kind == "python" else []
    p = ev.parent
    while p >= 0:
        parent = cap.events[p]
        if parent.stack:
            return tuple(out) + parent.stack
        if parent.kind == "python":
            out.append(parent.name)
        p = parent.parent
    return tuple(out)


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


def _ancestors(cap: Capture, i: int) -> Iterable[Event]:
    p = cap.events[i].parent
    while p >= 0:
        yield cap.events[p]
        p = cap.events[p].parent


# ----------------------------------------------------------------------------- source lines


@functools.lru_cache(maxsize=64)
def _parse(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _scope(tree: ast.Module, line: int, func: str) -> ast.AST:
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


def _walk_scope(scope: ast.AST) -> Iterable[tuple[ast.AST, int]]:
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


def _attr_call(node: ast.AST, names: Iterable[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in set(names)


def _is_tensor_index(node: ast.AST) -> bool:
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


def _contains_call(node: ast.AST, names: Iterable[str]) -> bool:
    return any(_attr_call(n, names) for n in ast.walk(node))


MATCHERS: dict[str, Callable[[ast.AST], bool]] = {
    "item": lambda n: _attr_call(n, ("item",)),
    "to_host": lambda n: _attr_call(n, ("cpu", "tolist", "numpy")),
    "nonzero": lambda n: _attr_call(n, ("nonzero", "argwhere", "where", "unique")),
    "bool_mask": lambda n: _is_tensor_index(n) or _attr_call(n, ("masked_select",)),
    "loop": lambda n: isinstance(n, ast.For | ast.AsyncFor) or _attr_call(n, ("next",)),
    "optimizer_step": lambda n: _attr_call(n, ("step",)),
    "copy": lambda n: _attr_call(n, ("to", "cuda", "copy_")),
}


def locate(frame: tuple[str, int, str], hint: str | None) -> tuple[str, list[int]]:
    """`file:line` for an op issued in `frame` by the construct `hint`, plus every candidate line.

    Candidates inside a loop come first (a step's work is in the loop); for `loop`, the `for`
    whose body steps the optimizer or calls backward wins."""
    path, line, func = frame
    tree = _parse(path) if hint else None
    if tree is None or hint not in MATCHERS:
        return f"{path}:{line}", [line]
    scope = _scope(tree, line, func)
    hits = [(node, depth) for node, depth in _walk_scope(scope) if MATCHERS[hint](node)]
    if not hits:
        return f"{path}:{line}", [line]
    if hint == "loop":
        steppers = [h for h in hits if _contains_call(h[0], ("step", "backward", "mark_step"))]
        hits = steppers or hits
        hits.sort(key=lambda h: (-h[1], h[0].lineno))  # innermost stepping loop
    else:
        hits.sort(key=lambda h: (h[1] == 0, h[0].lineno))
    lines = sorted({h[0].lineno for h in hits})
    return f"{path}:{hits[0][0].lineno}", lines


# ----------------------------------------------------------------------------- analyzers


SYNC_FIXES = {
    "item": "keep the value on the device and read it every N steps: `pending.append(loss.detach())`, "
    "then `torch.stack(pending).tolist()` at log points (slipstream.train does this)",
    "bool_mask": "reduce with the mask instead of indexing by it: `(x * mask).sum() / mask.sum().clamp(min=1)` "
    "(or `torch.where(mask, x, 0)`): no data-dependent shape, no sync",
    "nonzero": "avoid data-dependent shapes: `torch.where(mask, a, b)` or masked arithmetic, or "
    "`nonzero_static(size=...)` with a fixed size",
    "to_host": "move `.cpu()` / `.tolist()` / `.numpy()` out of the step (every N steps), or copy into pinned "
    "memory with `non_blocking=True` and read it a step later",
    "sync": "remove the host-device synchronization from the step (a blocking copy or an explicit synchronize)",
}
SYNC_TITLES = {
    "item": "host-device sync: .item() every step",
    "bool_mask": "host-device sync: boolean-mask indexing (data-dependent shape, nonzero)",
    "nonzero": "host-device sync: nonzero (data-dependent shape)",
    "to_host": "host-device sync: .cpu() / .tolist() / .numpy() in the step",
    "sync": "host-device sync: blocking copy or synchronize in the step",
}


def _sync_events(cap: Capture) -> list[tuple[int, str]]:
    """(event index, cause) of every host-device sync in the active steps, wherever it originates."""
    out: list[tuple[int, str]] = []
    for i, ev in _active_events(cap):
        if ev.device != "cpu":
            continue
        parents = [a.name for a in _ancestors(cap, i)]
        parent = parents[0] if parents else ""
        if ev.kind == "op":
            if ev.name == "aten::item":
                out.append((i, "item"))
            elif ev.name == "aten::_local_scalar_dense" and parent != "aten::item":
                out.append((i, "item"))
            elif ev.name in ("aten::index", "aten::index_put_") and (
                "bool" in ev.input_dtypes[1:] or _has_child(cap, i, "aten::nonzero")
            ):
                out.append((i, "bool_mask"))
            elif ev.name == "aten::masked_select":
                out.append((i, "bool_mask"))
            elif ev.name == "aten::nonzero" and not MASK_PARENTS.intersection(parents):
                out.append((i, "nonzero"))
        elif ev.kind == "python" and TO_HOST.match(ev.name):
            out.append((i, "to_host"))
        elif ev.kind == "runtime" and ev.name in CUDA_SYNC_CALLS:
            # Attribute it to the outermost op that issued it (item / to / copy_ ...).
            ops = [j for j in _ancestor_indices(cap, i) if cap.events[j].kind == "op"]
            if ops and not any(
                cap.events[j].name in ("aten::item", "aten::_local_scalar_dense") for j in ops
            ):
                out.append((ops[-1], "sync"))
    return out


def _ancestor_indices(cap: Capture, i: int) -> list[int]:
    out, p = [], cap.events[i].parent
    while p >= 0:
        out.append(p)
        p = cap.events[p].parent
    return out


def _children(cap: Capture) -> dict[int, list[int]]:
    cached = getattr(cap, "_children_cache", None)
    if cached is None:
        cached = defaultdict(list)
        for j, ev in enumerate(cap.events):
            if ev.parent >= 0:
                cached[ev.parent].append(j)
        cap._children_cache = cached  # type: ignore[attr-defined]  # derived, not captured data
    return cached


def _has_child(cap: Capture, i: int, name: str) -> bool:
    todo = list(_children(cap).get(i, ()))
    while todo:
        j = todo.pop()
        if cap.events[j].name == name:
            return True
        todo.extend(_children(cap).get(j, ()))
    return False


def find_host_syncs(cap: Capture) -> list[Finding]:
    """Per-step .item(), nonzero, boolean-mask indexing, .cpu()/.tolist(), blocking copies in user code."""
    groups: dict[tuple[str, str | None], list[int]] = defaultdict(list)
    for i, cause in _sync_events(cap):
        frame = caller_frame(stack_of(cap, i))
        if frame is None and cap.light:
            # No stacks: keep the syncs not issued inside the optimizer or the autograd engine.
            if any(
                a.kind == "op" or a.name.startswith(("Optimizer.", "autograd::engine"))
                for a in _ancestors(cap, i)
            ):
                continue  # issued inside another op (fused optimizer, backward ...): torch's own
            groups[(cause, None)].append(i)
            continue
        if frame is None or not is_user_file(frame[0], cap.own_code_is_user):
            continue  # issued inside torch or slipstream (optimizer internals ...): not the user's to fix
        where, _ = locate(frame, cause if cause != "sync" else None)
        groups[(cause, where)].append(i)
    # A .cpu() on CUDA shows up both as a Python call and as its blocking copy: keep the named cause.
    named = {w for (c, w) in groups if c != "sync"}
    findings = []
    steps, total = _steps(cap), _active_us(cap)
    for (cause, where), idx in groups.items():
        if cause == "sync" and where in named:
            continue
        per_step = len(idx) / steps
        share = sum(cap.events[i].dur_us for i in idx) / total
        sev: Severity = "warning" if per_step >= 1 else "info"
        extra = (
            ""
            if cap.device == "cuda"
            else " (on CPU nothing waits; on an accelerator each one stalls the host)"
        )
        findings.append(
            Finding(
                kind="host_sync",
                severity=sev,
                share_of_step=share,
                where=where,
                fix=SYNC_FIXES[cause],
                title=SYNC_TITLES[cause],
                detail=f"{per_step:g} per step{extra}",
                count_per_step=per_step,
                evidence={"cause": cause, "calls": len(idx), "time_per_step_s": share * total / steps / 1e6},
            )
        )
    return findings


def _data_events(cap: Capture) -> list[int]:
    return [
        i
        for i, e in _active_events(cap)
        if e.name.startswith("enumerate(DataLoader)#") or e.name.startswith("slipstream.data")
    ]


def find_data_starvation(cap: Capture) -> list[Finding]:
    """Steps waiting on the input pipeline (DataLoader __next__, or the built-in loop's data wait)."""
    idx = _data_events(cap)
    total, steps = _active_us(cap), _steps(cap)
    share = sum(cap.events[i].dur_us for i in idx) / total
    where = None
    if idx:
        frames = Counter(user_frame(stack_of(cap, i), cap.own_code_is_user) for i in idx)
        frames.pop(None, None)
        if frames:
            where, _ = locate(frames.most_common(1)[0][0], "loop")
    metric_share = 0.0
    if cap.metrics and cap.step_times_s:
        metric_share = float(cap.metrics.get("data_wait_s", 0.0)) / max(sum(cap.step_times_s), 1e-9)
    share = max(share, min(metric_share, 1.0))
    sev = _severity(share, warn=0.1, critical=0.3, info=0.03)
    if sev is None:
        return []
    fix = (
        "recipe dataflow.prefetch=true (and dataflow.workers=N for per-sample decoding)"
        if cap.own_code_is_user
        else "prepare batches ahead of the step: DataLoader(num_workers=N, pin_memory=True, "
        "persistent_workers=True, prefetch_factor=2); move per-sample work out of __getitem__ or cache it"
    )
    return [
        Finding(
            kind="data_starvation",
            severity=sev,
            share_of_step=share,
            where=where,
            fix=fix,
            title="data-loader starvation: the step waits for its batch",
            detail=f"{share:.0%} of step time waiting for data",
            count_per_step=len(idx) / steps if idx else None,
            evidence={"data_wait_per_step_s": share * total / steps / 1e6},
        )
    ]


def find_recompiles(cap: Capture) -> list[Finding]:
    """torch.compile recompilations during the run (all steps), with the guard that failed."""
    recs = [c for c in cap.compiles if c.is_recompile]
    metric_recompiles = int((cap.metrics or {}).get("recompiles", 0) or 0)
    if not recs and not metric_recompiles:
        return []
    run_s = max(sum(cap.step_times_s), 1e-9)
    reasons = [g["reason"] for g in cap.guard_failures]
    by_site: dict[str | None, list[Any]] = defaultdict(list)
    for c in recs:
        site = f"{c.call_site[0]}:{c.call_site[1]}" if c.call_site else None
        by_site[site].append(c)
    if not by_site:
        by_site[None] = []
    fix = (
        "recipe shapes.mode=bucket (a few planned lengths) or shapes.mode=pack (one shape)"
        if cap.own_code_is_user
        else "feed a fixed set of shapes: pad each batch up to one of a few lengths (round up to a multiple "
        "of 64, or slipstream's shapes.mode=bucket), or compile for varying sizes: "
        "torch.compile(dynamic=True) / torch._dynamo.mark_dynamic(x, dim)"
    )
    findings = []
    for site, group in by_site.items():
        n = len(group) or metric_recompiles
        compile_s = sum(c.duration_s for c in group)
        share = compile_s / run_s
        sev = _severity(share, warn=0.0, critical=0.3) or "warning"
        top = Counter(reasons).most_common(3)
        findings.append(
            Finding(
                kind="recompile",
                severity=sev,
                share_of_step=share,
                where=site,
                fix=fix,
                title=f"torch.compile recompiled {n} time(s)",
                detail=("reason: " + top[0][0]) if top else "reason: unknown (no guard failure recorded)",
                count_per_step=n / max(len(cap.step_times_s), 1),
                evidence={
                    "recompiles": n,
                    "recompile_s": compile_s,
                    "steps": [c.step for c in group],
                    "reasons": [r for r, _ in top],
                    "distinct_shapes": (cap.metrics or {}).get("distinct_shapes"),
                },
            )
        )
    return findings


def _top_level_ops(cap: Capture) -> list[int]:
    out = []
    for i, ev in _active_events(cap):
        if ev.kind == "op" and ev.device == "cpu" and not any(a.kind == "op" for a in _ancestors(cap, i)):
            out.append(i)
    return out


def find_launch_bound(cap: Capture) -> list[Finding]:
    """Many small ops: per-op dispatch (CPU) or launch (GPU) cost dominates the work."""
    steps, total = _steps(cap), _active_us(cap)
    if cap.device == "cuda":
        kernels = [e for _, e in _active_events(cap) if e.kind == "kernel" and "Memcpy" not in e.name]
        n = len(kernels)
        busy = _union_us([(e.start_us, e.end_us) for e in kernels])
        mean = (sum(e.dur_us for e in kernels) / n) if n else 0.0
        share = 1.0 - busy / total
        unit = "kernels"
    else:
        ops = _top_level_ops(cap)
        n = len(ops)
        mean = (sum(cap.events[i].dur_us for i in ops) / n) if n else 0.0
        share = sum(cap.events[i].dur_us for i in ops if cap.events[i].dur_us < SMALL_OP_US) / total
        unit = "ops"
    per_step = n / steps
    if per_step < 200 or mean >= 4 * SMALL_OP_US:
        return []
    sev = _severity(share, warn=0.2, critical=0.5, info=0.05)
    if sev is None:
        return []
    fix = "recipe compile.mode=default (torch.compile fuses small ops)" + (
        " and compile.cudagraphs=true (one launch per step)" if cap.device == "cuda" else ""
    )
    if not cap.own_code_is_user:
        fix += "; in your code: torch.compile(model), larger batches, fused optimizer"
    return [
        Finding(
            kind="launch_bound",
            severity=sev,
            share_of_step=share,
            where=None,
            fix=fix,
            title=f"launch-bound: {per_step:,.0f} {unit} per step, mean {mean:.1f} µs",
            detail=(
                "GPU idle between kernels"
                if cap.device == "cuda"
                else f"time in ops under {SMALL_OP_US:g} µs"
            ),
            count_per_step=per_step,
            evidence={f"{unit}_per_step": per_step, f"mean_{unit[:-1]}_us": mean},
        )
    ]


def find_padding_waste(cap: Capture) -> list[Finding]:
    """Compute spent on padding tokens (built-in loop: from the loader's accounting)."""
    waste = float((cap.metrics or {}).get("padding_waste", 0.0) or 0.0)
    sev = _severity(waste, warn=0.25, critical=0.6, info=0.1)
    if sev is None:
        return []
    return [
        Finding(
            kind="padding_waste",
            severity=sev,
            share_of_step=waste,
            where=None,
            fix="recipe shapes.mode=bucket (pad to planned length buckets) or shapes.mode=pack "
            "(documents packed into full rows)",
            title=f"padding waste: {waste:.0%} of tokens are padding",
            detail="every padded position costs the same compute as a real one",
            evidence={
                "padding_waste": waste,
                "padded_tokens": (cap.metrics or {}).get("padded_tokens"),
                "real_tokens": (cap.metrics or {}).get("real_tokens"),
            },
        )
    ]


def find_fp32_matmuls(cap: Capture) -> list[Finding]:
    """fp32 matmuls/convolutions/attention where bf16 matmuls measured faster than fp32 (the
    machine probe). Where bf16 merely runs (at 0.55x fp32 on an Intel AVX512-BF16 CPU without
    AMX, 1/75 on AVX2-only ones) the advice would slow the step down, so it is not given."""
    if not cap.bf16_pays:
        return []
    hits = []
    for i, ev in _active_events(cap):
        if ev.name not in MATMUL_OPS or not ev.input_dtypes:
            continue
        if ev.input_dtypes[0] != "float" or any(a.name in MATMUL_OPS for a in _ancestors(cap, i)):
            continue
        hits.append(i)
    if not hits:
        return []
    share = sum(cap.events[i].dur_us for i in hits) / _active_us(cap)
    sev = _severity(share, warn=0.1, critical=0.5, info=0.02)
    if sev is None:
        return []
    frames = Counter(user_frame(stack_of(cap, i), cap.own_code_is_user) for i in hits)
    frames.pop(None, None)
    where = None
    if frames:
        path, line, _ = frames.most_common(1)[0][0]
        where = f"{path}:{line}"
    fix = (
        "recipe precision.dtype=bf16"
        if cap.own_code_is_user
        else f"run forward and loss under `torch.autocast('{cap.device}', dtype=torch.bfloat16)` "
        "(or slipstream's precision.dtype=bf16)"
    )
    return [
        Finding(
            kind="fp32_matmul",
            severity=sev,
            share_of_step=share,
            where=where,
            fix=fix,
            title="fp32 matmuls where bf16 measured faster",
            detail=f"{share:.0%} of step time in fp32 matmul/conv/attention; on this {cap.device}: "
            f"{cap.bf16_verdict or 'bf16 matmuls measured faster than fp32'}",
            count_per_step=len(hits) / _steps(cap),
            evidence={
                "fp32_matmul_time_per_step_s": share * _active_us(cap) / _steps(cap) / 1e6,
                "bf16_verdict": cap.bf16_verdict,
            },
        )
    ]


def find_unpinned_copies(cap: Capture) -> list[Finding]:
    """Host-to-device copies from pageable memory (CUDA): synchronous, and slower than pinned."""
    hits = [
        i
        for i, e in _active_events(cap)
        if e.kind == "op" and any("HtoD" in k and "Pageable" in k for k in e.kernels)
    ]
    if not hits:
        return []
    groups: dict[str | None, list[int]] = defaultdict(list)
    for i in hits:
        frame = user_frame(stack_of(cap, i), cap.own_code_is_user)
        groups[locate(frame, "copy")[0] if frame else None].append(i)
    out = []
    for where, idx in groups.items():
        per_step = len(idx) / _steps(cap)
        out.append(
            Finding(
                kind="unpinned_copy",
                severity="warning" if per_step >= 1 else "info",
                share_of_step=sum(cap.events[i].dur_us for i in idx) / _active_us(cap),
                where=where,
                fix="pin the host batch and copy asynchronously: DataLoader(pin_memory=True) and "
                "`.to(device, non_blocking=True)` (slipstream: dataflow.prefetch=true)",
                title="unpinned host-to-device copies",
                detail=f"{per_step:g} pageable copies per step",
                count_per_step=per_step,
            )
        )
    return out


def _optimizer_impl(cap: Capture, ev: Event) -> str:
    names = [
        e.name
        for e in cap.events
        if e.kind == "op" and e.thread == ev.thread and ev.start_us <= e.start_us <= ev.end_us
    ]
    if any("_fused_" in n for n in names):
        return "fused"
    if any("_foreach_" in n for n in names):
        return "foreach"
    return "for-loop"


def find_unfused_optimizer(cap: Capture) -> list[Finding]:
    """An optimizer that updates parameter by parameter (for-loop) or per op (foreach) instead of fused."""
    steps_ev = [(i, e) for i, e in _active_events(cap) if e.name.startswith("Optimizer.step#")]
    if not steps_ev:
        return []
    impl = _optimizer_impl(cap, steps_ev[0][1])
    if impl == "fused":
        return []
    share = sum(e.dur_us for _, e in steps_ev) / _active_us(cap)
    sev = _severity(share, warn=0.05, critical=0.3, info=0.01) if impl == "for-loop" else None
    if impl == "foreach" and share >= 0.02:
        sev = "info"
    if sev is None:
        return []
    where = None
    frame = user_frame(stack_of(cap, steps_ev[0][0]), cap.own_code_is_user)
    if frame is not None:
        where, _ = locate(frame, "optimizer_step")
    name = steps_ev[0][1].name.split("#", 1)[1].split(".")[0]
    fix = (
        "recipe optimizer.impl=fused"
        if cap.own_code_is_user
        else f"torch.optim.{name}(params, ..., fused=True) (slipstream: optimizer.impl=fused)"
    )
    return [
        Finding(
            kind="optimizer_not_fused",
            severity=sev,
            share_of_step=share,
            where=where,
            fix=fix,
            title=f"optimizer not fused ({name}, {impl})",
            detail=f"{share:.0%} of step time in optimizer.step",
            evidence={"optimizer": name, "impl": impl},
        )
    ]


ANALYZERS: tuple[Callable[[Capture], list[Finding]], ...] = (
    find_host_syncs,
    find_data_starvation,
    find_recompiles,
    find_launch_bound,
    find_padding_waste,
    find_fp32_matmuls,
    find_unpinned_copies,
    find_unfused_optimizer,
)


# ----------------------------------------------------------------------------- tables

CATEGORIES = ("data_wait", "sync", "copy", "optimizer", "compute")
"""Breakdown categories in priority order: where they overlap, the earlier one owns the time."""


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _category(cap: Capture, i: int, ev: Event, syncs: set[int]) -> str | None:
    if i in syncs:
        return "sync"
    if ev.name.startswith(("enumerate(DataLoader)#", "slipstream.data")):
        return "data_wait"
    if ev.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if ev.kind == "kernel":
        return "copy" if "Memcpy" in ev.name else "compute"
    if ev.kind == "op":
        if any("Memcpy" in k for k in ev.kernels) or ev.name in ("aten::pin_memory", "aten::_pin_memory"):
            return "copy"
        return "compute"
    if ev.kind == "runtime" and ev.name in CUDA_SYNC_CALLS:
        return "sync"
    if ev.kind == "annotation" and not ev.name.startswith("ProfilerStep"):
        return "compute"
    return None


def time_breakdown(cap: Capture) -> list[dict[str, Any]]:
    """Step wall time split into data_wait, sync, copy, optimizer, compute and other (the rest:
    Python, idle). Rows: category, time_per_step_s, share_of_step; shares add up to 1."""
    if not cap.step_windows_us:
        return []
    lo, hi = cap.step_windows_us[0][0], cap.step_windows_us[-1][1]
    syncs = {i for i, cause in _sync_events(cap) if cause != "to_host"}
    edges: list[tuple[float, int, int]] = []
    for i, ev in _active_events(cap):
        cat = _category(cap, i, ev, syncs)
        if cat is None:
            continue
        a, b = max(ev.start_us, lo), min(ev.end_us, hi)
        if b > a:
            k = CATEGORIES.index(cat)
            edges += [(a, 1, k), (b, -1, k)]
    edges.sort()
    spent = [0.0] * (len(CATEGORIES) + 1)
    live = [0] * len(CATEGORIES)
    t = lo
    for x, delta, k in edges:
        if x > t:
            owner = next((c for c in range(len(CATEGORIES)) if live[c] > 0), len(CATEGORIES))
            spent[owner] += x - t
            t = x
        live[k] += delta
    spent[-1] += max(hi - t, 0.0)
    span = hi - lo
    steps = _steps(cap)
    rows = [
        {"category": name, "time_per_step_s": s / steps / 1e6, "share_of_step": s / span if span else 0.0}
        for name, s in zip((*CATEGORIES, "other"), spent)
    ]
    # The built-in loop's own loader is not annotated: take its measured wait out of "other".
    if cap.metrics and cap.step_times_s and rows[0]["share_of_step"] == 0.0:
        wait_share = float(cap.metrics.get("data_wait_s", 0.0) or 0.0) / max(sum(cap.step_times_s), 1e-9)
        moved = min(wait_share, rows[-1]["share_of_step"])
        rows[0]["share_of_step"] += moved
        rows[-1]["share_of_step"] -= moved
        per_step = sum(r["time_per_step_s"] for r in rows)
        for r in rows:
            r["time_per_step_s"] = r["share_of_step"] * per_step
    return rows


def op_table(cap: Capture, top: int = 15) -> list[dict[str, Any]]:
    """Top-level host ops by time: op, calls_per_step, time_per_step_s, mean_us, share_of_step."""
    steps, total = _steps(cap), _active_us(cap)
    agg: dict[str, list[float]] = defaultdict(list)
    for i in _top_level_ops(cap):
        agg[cap.events[i].name].append(cap.events[i].dur_us)
    rows = [
        {
            "op": name,
            "calls_per_step": len(d) / steps,
            "time_per_step_s": sum(d) / steps / 1e6,
            "mean_us": sum(d) / len(d),
            "share_of_step": sum(d) / total,
        }
        for name, d in agg.items()
    ]
    rows.sort(key=lambda r: -r["time_per_step_s"])
    return rows[:top]


def overhead(cap: Capture) -> dict[str, Any]:
    """Profiled vs unprofiled step time, same run: the active steps against the wait steps after
    the first and the tail steps. overhead_ratio = profiled / unprofiled median step time."""
    prof = [t for t, p in zip(cap.step_times_s, cap.step_phases) if p == "active"]
    base = [
        t
        for k, (t, p) in enumerate(zip(cap.step_times_s, cap.step_phases))
        if k > 0 and p in ("wait", "tail")
    ]
    out: dict[str, Any] = {
        "profiled_step_s": statistics.median(prof) if prof else None,
        "unprofiled_step_s": statistics.median(base) if base else None,
        "profiled_steps": len(prof),
        "unprofiled_steps": len(base),
        "overhead_ratio": None,
        "postprocess_s": cap.postprocess_s,
        "mode": "light" if cap.light else "full",
    }
    if prof and base and out["unprofiled_step_s"] > 0:
        out["overhead_ratio"] = out["profiled_step_s"] / out["unprofiled_step_s"]
    return out


# ----------------------------------------------------------------------------- facade


@dataclass
class ProfileResult:
    findings: list[Finding]
    breakdown: list[dict[str, Any]]
    ops: list[dict[str, Any]]
    overhead: dict[str, Any]
    capture: Capture
    step_time_s: float
    """Mean wall time of a recorded step."""

    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in ("warning", "critical")]

    def to_dict(self) -> dict[str, Any]:
        cap = self.capture
        return {
            "schema": "slipstream.profile/2",
            "source": cap.source,
            "device": cap.device,
            "bf16_pays": cap.bf16_pays,
            "bf16_verdict": cap.bf16_verdict,
            "mode": "light" if cap.light else "full",
            "light_reason": cap.light_reason,
            "schedule": {
                "wait": cap.config.wait,
                "warmup": cap.config.warmup,
                "active": cap.config.active,
                "tail": cap.config.tail,
            },
            "step_source": cap.step_source,
            "steps_run": len(cap.step_times_s),
            "steps_profiled": len(cap.step_windows_us),
            "step_time_s": self.step_time_s,
            "step_times_s": cap.step_times_s,
            "step_phases": cap.step_phases,
            "overhead": self.overhead,
            "breakdown": self.breakdown,
            "findings": [f.to_dict() for f in self.findings],
            "top_ops": self.ops,
            "compiles": [
                {
                    "compile_id": c.compile_id,
                    "step": c.step,
                    "compile_s": c.duration_s,
                    "recompile": c.is_recompile,
                    "call_site": f"{c.call_site[0]}:{c.call_site[1]}" if c.call_site else None,
                }
                for c in cap.compiles
            ],
            "guard_failures": cap.guard_failures,
            "metrics": cap.metrics,
            "trace_path": cap.trace_path,
            "script_exit": cap.script_exit,
        }


def analyze(
    cap: Capture, analyzers: Sequence[Callable[[Capture], list[Finding]]] = ANALYZERS
) -> ProfileResult:
    findings = [f for a in analyzers for f in a(cap)]
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -f.share_of_step))
    return ProfileResult(
        findings=findings,
        breakdown=time_breakdown(cap),
        ops=op_table(cap),
        overhead=overhead(cap),
        capture=cap,
        step_time_s=_active_us(cap) / _steps(cap) / 1e6 if cap.step_windows_us else 0.0,
    )


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
