"""Host syncs: .item(), .tolist(), boolean-mask indexing and other calls that stall the device."""

from __future__ import annotations

from collections import defaultdict

from ..frames import is_user_file
from ..records import Capture
from ..source import caller_frame, locate
from ..trace import Finding, Severity, active_us, ancestors, stack_of, step_count, sync_events

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


def find_host_syncs(cap: Capture) -> list[Finding]:
    """Per-step .item(), nonzero, boolean-mask indexing, .cpu()/.tolist(), blocking copies in user code."""
    groups: dict[tuple[str, str | None], list[int]] = defaultdict(list)
    for i, cause in sync_events(cap):
        frame = caller_frame(stack_of(cap, i))
        if frame is None and cap.light:
            # No stacks: keep the syncs not issued inside the optimizer or the autograd engine.
            if any(
                a.kind == "op" or a.name.startswith(("Optimizer.", "autograd::engine"))
                for a in ancestors(cap, i)
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
    steps, total = step_count(cap), active_us(cap)
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
