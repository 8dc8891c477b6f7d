"""What a capture holds, step by step: the events inside steps, their stacks and parents, and
the Finding every analyzer returns."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .records import Capture, Event

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


def step_count(cap: Capture) -> int:
    return max(1, len(cap.step_windows_us))


def active_us(cap: Capture) -> float:
    return sum(b - a for a, b in cap.step_windows_us) or 1.0


def in_steps(cap: Capture, ev: Event) -> bool:
    if not cap.step_windows_us:
        return False
    return cap.step_windows_us[0][0] <= ev.start_us <= cap.step_windows_us[-1][1]


def active_events(cap: Capture) -> list[tuple[int, Event]]:
    return [(i, e) for i, e in enumerate(cap.events) if in_steps(cap, e)]


def severity_for(share: float, warn: float, critical: float, info: float = 0.0) -> Severity | None:
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


def ancestors(cap: Capture, i: int) -> Iterable[Event]:
    p = cap.events[i].parent
    while p >= 0:
        yield cap.events[p]
        p = cap.events[p].parent


def sync_events(cap: Capture) -> list[tuple[int, str]]:
    """(event index, cause) of every host-device sync in the active steps, wherever it originates."""
    out: list[tuple[int, str]] = []
    for i, ev in active_events(cap):
        if ev.device != "cpu":
            continue
        parents = [a.name for a in ancestors(cap, i)]
        parent = parents[0] if parents else ""
        if ev.kind == "op":
            if ev.name == "aten::item":
                out.append((i, "item"))
            elif ev.name == "aten::_local_scalar_dense" and parent != "aten::item":
                out.append((i, "item"))
            elif ev.name in ("aten::index", "aten::index_put_") and (
                "bool" in ev.input_dtypes[1:] or has_child(cap, i, "aten::nonzero")
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
            ops = [j for j in ancestor_indices(cap, i) if cap.events[j].kind == "op"]
            if ops and not any(
                cap.events[j].name in ("aten::item", "aten::_local_scalar_dense") for j in ops
            ):
                out.append((ops[-1], "sync"))
    return out


def ancestor_indices(cap: Capture, i: int) -> list[int]:
    out, p = [], cap.events[i].parent
    while p >= 0:
        out.append(p)
        p = cap.events[p].parent
    return out


def children_of(cap: Capture) -> dict[int, list[int]]:
    cached = getattr(cap, "_children_cache", None)
    if cached is None:
        cached = defaultdict(list)
        for j, ev in enumerate(cap.events):
            if ev.parent >= 0:
                cached[ev.parent].append(j)
        cap._children_cache = cached  # type: ignore[attr-defined]  # derived, not captured data
    return cached


def has_child(cap: Capture, i: int, name: str) -> bool:
    todo = list(children_of(cap).get(i, ()))
    while todo:
        j = todo.pop()
        if cap.events[j].name == name:
            return True
        todo.extend(children_of(cap).get(j, ()))
    return False


def data_events(cap: Capture) -> list[int]:
    return [
        i
        for i, e in active_events(cap)
        if e.name.startswith("enumerate(DataLoader)#") or e.name.startswith("slipstream.data")
    ]


def top_level_ops(cap: Capture) -> list[int]:
    out = []
    for i, ev in active_events(cap):
        if ev.kind == "op" and ev.device == "cpu" and not any(a.kind == "op" for a in ancestors(cap, i)):
            out.append(i)
    return out
