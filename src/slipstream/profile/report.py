"""Report: the findings table in the terminal and the JSON document (schema: docs/profile.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files import write_json
from .analyze import ProfileResult
from .source import relative

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}


def write_profile(result: ProfileResult, path: str | Path) -> Path:
    """Write the profile document (schema: docs/profile.md) atomically."""
    write_json(path, result.to_dict())
    return Path(path)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def render(result: ProfileResult, console: Any = None) -> None:
    """Findings, time breakdown and overhead as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cap = result.capture
    what = cap.source.get("workload") or cap.source.get("script") or cap.source.get("module")
    over = result.overhead
    ratio = over.get("overhead_ratio")
    console.print(
        f"[bold]slipstream profile[/] {what} · {cap.device} · {len(cap.step_windows_us)} step(s) profiled "
        f"({cap.step_source}) · step {result.step_time_s * 1e3:.1f} ms · profiler overhead "
        + (f"{ratio:.2f}× ({over['mode']} mode)" if ratio else "not measured (too few unprofiled steps)")
    )

    table = Table(title="findings (fixes below)")
    table.add_column("#", justify="right")
    table.add_column("severity")
    table.add_column("share of step", justify="right")
    table.add_column("where", no_wrap=True)
    table.add_column("finding")
    for n, f in enumerate(result.findings, 1):
        sev = f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/]"
        text = f.title + (f"\n[dim]{f.detail}[/]" if f.detail else "")
        table.add_row(str(n), sev, _pct(f.share_of_step), relative(f.where) or "-", text)
    if result.findings:
        console.print(table)
        for n, f in enumerate(result.findings, 1):
            console.print(f"  [bold]#{n} fix:[/] {f.fix}", highlight=False)
    else:
        console.print("no findings: nothing in the profiled steps matched a known problem")

    bd = Table(title="time per step")
    bd.add_column("category")
    bd.add_column("ms / step", justify="right")
    bd.add_column("share", justify="right")
    for row in result.breakdown:
        bd.add_row(row["category"], f"{row['time_per_step_s'] * 1e3:.2f}", _pct(row["share_of_step"]))
    console.print(bd)
    if cap.trace_path:
        console.print(f"trace: {cap.trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
