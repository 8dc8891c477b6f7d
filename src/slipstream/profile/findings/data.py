"""Data starvation: steps waiting for their batch."""

from __future__ import annotations

from collections import Counter

from ..records import Capture
from ..source import locate, user_frame
from ..trace import Finding, active_us, data_events, severity_for, stack_of, step_count


def find_data_starvation(cap: Capture) -> list[Finding]:
    """Steps waiting on the input pipeline (DataLoader __next__, or the built-in loop's data wait)."""
    idx = data_events(cap)
    total, steps = active_us(cap), step_count(cap)
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
    sev = severity_for(share, warn=0.1, critical=0.3, info=0.03)
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
