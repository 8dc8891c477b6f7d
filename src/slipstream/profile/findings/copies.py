"""Host-to-device copies from unpinned memory."""

from __future__ import annotations

from collections import defaultdict

from ..records import Capture
from ..source import locate, user_frame
from ..trace import Finding, active_events, active_us, stack_of, step_count


def find_unpinned_copies(cap: Capture) -> list[Finding]:
    """Host-to-device copies from pageable memory (CUDA): synchronous, and slower than pinned."""
    hits = [
        i
        for i, e in active_events(cap)
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
        per_step = len(idx) / step_count(cap)
        out.append(
            Finding(
                kind="unpinned_copy",
                severity="warning" if per_step >= 1 else "info",
                share_of_step=sum(cap.events[i].dur_us for i in idx) / active_us(cap),
                where=where,
                fix="pin the host batch and copy asynchronously: DataLoader(pin_memory=True) and "
                "`.to(device, non_blocking=True)` (slipstream: dataflow.prefetch=true)",
                title="unpinned host-to-device copies",
                detail=f"{per_step:g} pageable copies per step",
                count_per_step=per_step,
            )
        )
    return out
