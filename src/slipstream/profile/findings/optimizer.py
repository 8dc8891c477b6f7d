"""Unfused optimizers: one kernel per parameter where a fused or foreach step exists."""

from __future__ import annotations

from ..records import Capture, Event
from ..source import locate, user_frame
from ..trace import Finding, active_events, active_us, severity_for, stack_of


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
    steps_ev = [(i, e) for i, e in active_events(cap) if e.name.startswith("Optimizer.step#")]
    if not steps_ev:
        return []
    impl = _optimizer_impl(cap, steps_ev[0][1])
    if impl == "fused":
        return []
    share = sum(e.dur_us for _, e in steps_ev) / active_us(cap)
    sev = severity_for(share, warn=0.05, critical=0.3, info=0.01) if impl == "for-loop" else None
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
