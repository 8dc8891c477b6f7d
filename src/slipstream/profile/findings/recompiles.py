"""Recompiles: torch.compile building graphs again after the first step, with their call sites."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..records import Capture
from ..trace import Finding, severity_for


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
        sev = severity_for(share, warn=0.0, critical=0.3) or "warning"
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
