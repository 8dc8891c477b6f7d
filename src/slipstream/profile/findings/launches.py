"""Launch-bound steps: many small ops whose launch cost exceeds their work."""

from __future__ import annotations

from ..records import Capture
from ..tables import _union_us
from ..trace import SMALL_OP_US, Finding, active_events, active_us, severity_for, step_count, top_level_ops


def find_launch_bound(cap: Capture) -> list[Finding]:
    """Many small ops: per-op dispatch (CPU) or launch (GPU) cost dominates the work."""
    steps, total = step_count(cap), active_us(cap)
    if cap.device == "cuda":
        kernels = [e for _, e in active_events(cap) if e.kind == "kernel" and "Memcpy" not in e.name]
        n = len(kernels)
        busy = _union_us([(e.start_us, e.end_us) for e in kernels])
        mean = (sum(e.dur_us for e in kernels) / n) if n else 0.0
        share = 1.0 - busy / total
        unit = "kernels"
    else:
        ops = top_level_ops(cap)
        n = len(ops)
        mean = (sum(cap.events[i].dur_us for i in ops) / n) if n else 0.0
        share = sum(cap.events[i].dur_us for i in ops if cap.events[i].dur_us < SMALL_OP_US) / total
        unit = "ops"
    per_step = n / steps
    if per_step < 200 or mean >= 4 * SMALL_OP_US:
        return []
    sev = severity_for(share, warn=0.2, critical=0.5, info=0.05)
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
