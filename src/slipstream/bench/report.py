"""Bench output: a terminal table, Markdown, and a self-contained HTML page with plots.

Numbers come from BenchResult; this module only draws them (plots are PNGs embedded as base64,
so the page opens without a network).
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from ..files import atomic_write_text

COLUMNS = [
    ("contender", lambda c: c["name"]),
    ("real tok/s", lambda c: f"{c['real_tokens_per_s']:,.0f} ± {c['real_tokens_per_s_iqr'] / 2:,.0f}"),
    ("speedup", lambda c: f"{c['speedup']:.2f}×"),
    ("step s", lambda c: f"{c['step_time_s']:.3f}"),
    ("pad waste", lambda c: f"{c['padding_waste']:.3f}"),
    ("data wait s", lambda c: f"{c['data_wait_s']:.2f}"),
    ("shapes", lambda c: str(c["distinct_shapes"])),
    ("recompiles", lambda c: str(c["recompiles"])),
    ("compile s", lambda c: f"{c['compile_s']:.1f}"),
    (
        "peak MiB",
        lambda c: "—" if c["peak_memory_bytes"] is None else f"{c['peak_memory_bytes'] / 2**20:,.0f}",
    ),
    ("MFU", lambda c: f"{c['mfu'] * 100:.1f}%"),
    ("val loss", lambda c: f"{c['val_loss']:.4f}"),
    (
        "parity",
        lambda c: (
            c["parity"] if c["parity"] == "reference" else f"{c['parity']} ({c['parity_gap'] * 100:.1f}%)"
        ),
    ),
]


def rows(result: dict[str, Any]) -> list[list[str]]:
    return [[fmt(c) for _, fmt in COLUMNS] for c in result["contenders"]]


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["method"]
    table = Table(
        title=f"slipstream bench · {result['workload']} ({result['size']}) · {result['machine']['device']} · "
        f"{m['rounds']} interleaved rounds of {m['round_real_tokens']:,} real tokens"
    )
    for name, _ in COLUMNS:
        table.add_column(name, justify="left" if name == "contender" else "right")
    for row in rows(result):
        table.add_row(*row)
    console = Console(width=None if Console().is_terminal else 200)
    console.print(table)
    for name, why in result["skipped"].items():
        console.print(f"[yellow]{name} not run: {why}[/yellow]")
    for w in result["warnings"]:
        console.print(f"[yellow]warning: {w}[/yellow]")


def _steps_words(m: dict[str, Any]) -> str:
    """How long the reference trained before the verdict, and whether that was long enough."""
    trained, needed = m.get("parity_steps_trained"), m.get("parity_min_steps")
    if trained is None or needed is None:
        return ""  # a result written before the step budget existed
    enough = "" if trained >= needed else f", fewer than the {needed} a pass needs: passes read unjudged"
    rounds = f"{m['rounds']} round" + ("s" if m["rounds"] != 1 else "")
    return f"; judged after {trained} optimizer steps ({rounds}{enough})"


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The verdict in words: the parity band, and what `auto` picked against the fixed recipes and
    the peers (when an `auto` contender ran)."""
    m = result["method"]
    out = []
    if m.get("parity_design") == "paired":
        losses = ", ".join(f"{v:.4f}" for v in m["parity_noise_val_losses"])
        detect = m.get("parity_detectable_effect")
        band = (
            "no order re-runs, as no verdict rested on them; each row is judged on the band its "
            "parity_band_kind names (numerics, precision, batching check, twin)"
            if len(m["parity_noise_val_losses"]) < 2
            else f"pass when the val-loss gap is <= {m['parity_tolerance']:.2%} and the run would catch a "
            f"{m['parity_resolution']:.0%} regression; this one would catch >= "
            f"{'nothing (no null re-runs)' if detect is None else f'{detect:.2%}'} "
            f"(null band from {m['parity_band_source']}: val losses {losses})"
        )
        out.append("parity (paired: same init, same document windows): " + band + _steps_words(m))
    elif "parity_noise_band" in m:
        losses = ", ".join(f"{v:.4f}" for v in m["parity_noise_val_losses"])
        out.append(
            f"parity: pass when the val-loss gap is <= {m['parity_tolerance']:.2%} (seed noise band "
            f"{m['parity_noise_band']:.2%} from reference runs {losses}; floor {m['parity_floor']:.2%})"
        )
    cs = result["contenders"]
    auto = next((c for c in cs if c["name"].split("+")[0] == "auto"), None)
    if auto is None:
        return out
    picks = (
        ", ".join(f"{d['field']}={d['choice']}" for d in (auto["info"].get("decisions_list") or []))
        or "see info.decisions"
    )
    fixed = [c for c in cs if c["kind"] == "recipe" and c is not auto and c["parity"] != "fail"]
    peers = [c for c in cs if c["kind"] == "peer"]
    line = f"auto picked {picks}: {auto['speedup']:.2f}x baseline"
    if fixed:
        best = max(fixed, key=lambda c: c["real_tokens_per_s"])
        line += f", {auto['real_tokens_per_s'] / best['real_tokens_per_s']:.2f}x the fastest fixed recipe ({best['name']})"
    if peers:
        best = max(peers, key=lambda c: c["real_tokens_per_s"])
        line += f", {auto['real_tokens_per_s'] / best['real_tokens_per_s']:.2f}x the fastest peer ({best['name']})"
    how = f" ({auto['parity_band_kind']})" if auto.get("parity_band_kind") else ""
    out.append(line + f"; parity {auto['parity']}{how}")
    return out


def print_summary(result: dict[str, Any]) -> None:
    for line in summary_lines(result):
        print(line)


def markdown(result: dict[str, Any]) -> str:
    head = [name for name, _ in COLUMNS]
    lines = [
        f"# slipstream bench: {result['workload']} ({result['size']})",
        "",
        f"Machine: {result['machine']['device']}, torch {result['machine']['torch']}, {result['machine']['date']}. "
        f"Method: {result['method']['order']}; {result['method']['rounds']} rounds of "
        f"{result['method']['round_real_tokens']:,} real tokens each; peak matmul "
        f"fp32 {result['peak_flops']['fp32'] / 1e9:.0f} / bf16 {result['peak_flops']['bf16'] / 1e9:.0f} GFLOP/s.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    lines += ["", *summary_lines(result)]
    for peer, why in result["skipped"].items():
        lines.append(f"\nPeer `{peer}` not run: {why}")
    for w in result["warnings"]:
        lines.append(f"\nWarning: {w}")
    return "\n".join(lines) + "\n"


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(result: dict[str, Any]) -> dict[str, str]:
    """Four figures as base64 PNGs: throughput, time breakdown, padding waste, loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = result["contenders"]
    names = [c["name"] for c in cs]
    out = {}

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(cs)))
    ax.barh(names, [c["real_tokens_per_s"] for c in cs], xerr=[c["real_tokens_per_s_iqr"] / 2 for c in cs])
    ax.set_xlabel("real tokens/s (median, bars: IQR)")
    ax.invert_yaxis()
    out["throughput"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(cs)))
    left = [0.0] * len(cs)
    for part in ("compute", "data_wait"):
        per_step = [c["time_breakdown_s"].get(part, 0.0) / max(c["steps"], 1) for c in cs]
        ax.barh(names, per_step, left=left, label=part)
        left = [a + b for a, b in zip(left, per_step)]
    ax.set_xlabel("seconds per step")
    ax.legend()
    ax.invert_yaxis()
    out["breakdown"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(cs)))
    ax.barh(names, [c["padding_waste"] for c in cs], color="tab:orange")
    ax.set_xlabel("padding waste (fraction of batch positions)")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    out["waste"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cs:
        if c["loss_curve"]:
            xs, ys = zip(*c["loss_curve"])
            ax.plot(xs, ys, label=c["name"], linewidth=1)
    ax.set_xlabel("real tokens seen (timed rounds)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    out["loss"] = _png(fig)
    plt.close(fig)
    return out


def write_html(result: dict[str, Any], path: Path) -> Path:
    images = plots(result)
    head = "".join(f"<th>{html.escape(n)}</th>" for n, _ in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows(result))
    notes = "".join(
        f"<p class=warn>peer {html.escape(p)} not run: {html.escape(w)}</p>"
        for p, w in result["skipped"].items()
    )
    notes += "".join(f"<p class=warn>warning: {html.escape(w)}</p>" for w in result["warnings"])
    figs = "".join(
        f"<figure><img alt='{k}' src='data:image/png;base64,{v}'><figcaption>{k}</figcaption></figure>"
        for k, v in images.items()
    )
    m = result["machine"]
    page = f"""<!doctype html><html><head><meta charset=utf-8><title>slipstream bench</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}.warn{{color:#a60}}figure{{display:inline-block}}</style>
</head><body><h1>slipstream bench: {html.escape(result["workload"])} ({html.escape(result["size"])})</h1>
<p>{html.escape(m["device"])} · torch {html.escape(m["torch"])} · {html.escape(m["date"])} ·
{html.escape(result["method"]["order"])} · {result["method"]["rounds"]} rounds of
{result["method"]["round_real_tokens"]:,} real tokens · wall {result["wall_s"]:.0f} s</p>
<table><tr>{head}</tr>{body}</table>{notes}{figs}</body></html>"""
    atomic_write_text(Path(path), page)
    md = Path(path).with_suffix(".md")
    atomic_write_text(md, markdown(result))
    return Path(path)
