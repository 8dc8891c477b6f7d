"""Tables over a capture: where step time goes by category, the top ops, the profiler's overhead.
Rows' keys carry their units."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from .records import Capture, Event
from .trace import CUDA_SYNC_CALLS, active_events, active_us, step_count, sync_events, top_level_ops

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
    syncs = {i for i, cause in sync_events(cap) if cause != "to_host"}
    edges: list[tuple[float, int, int]] = []
    for i, ev in active_events(cap):
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
    steps = step_count(cap)
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
    steps, total = step_count(cap), active_us(cap)
    agg: dict[str, list[float]] = defaultdict(list)
    for i in top_level_ops(cap):
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
