"""fp32 matmuls where the machine has a faster dtype."""

from __future__ import annotations

from collections import Counter

from ..records import Capture
from ..source import user_frame
from ..trace import (
    MATMUL_OPS,
    Finding,
    active_events,
    active_us,
    ancestors,
    severity_for,
    stack_of,
    step_count,
)


def find_fp32_matmuls(cap: Capture) -> list[Finding]:
    """fp32 matmuls/convolutions/attention where bf16 matmuls measured faster than fp32 (the
    machine probe). Where bf16 merely runs (at 0.55x fp32 on an Intel AVX512-BF16 CPU without
    AMX, 1/75 on AVX2-only ones) the advice would slow the step down, so it is not given."""
    if not cap.bf16_pays:
        return []
    hits = []
    for i, ev in active_events(cap):
        if ev.name not in MATMUL_OPS or not ev.input_dtypes:
            continue
        if ev.input_dtypes[0] != "float" or any(a.name in MATMUL_OPS for a in ancestors(cap, i)):
            continue
        hits.append(i)
    if not hits:
        return []
    share = sum(cap.events[i].dur_us for i in hits) / active_us(cap)
    sev = severity_for(share, warn=0.1, critical=0.5, info=0.02)
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
            count_per_step=len(hits) / step_count(cap),
            evidence={
                "fp32_matmul_time_per_step_s": share * active_us(cap) / step_count(cap) / 1e6,
                "bf16_verdict": cap.bf16_verdict,
            },
        )
    ]
