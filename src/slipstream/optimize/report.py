"""optimize's outputs: the winning recipe file, and the candidates as JSON, Markdown and HTML."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..files import atomic_write_text
from ..presets import resolve_recipe
from ..recipe import save_recipe


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _against(candidate: dict[str, Any]) -> str:
    """Where a gap was measured from, when not the reference (numerics on kept batching)."""
    return f" vs `{candidate['parity_against']}`" if candidate.get("parity_against") else ""


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# slipstream optimize: {result['workload']} ({result['size']}) from `{result['base']}`",
        "",
        f"Machine: {result['machine'].get('cpu', result['machine']['device'])} "
        f"({result['machine'].get('cpu_capability', '?')}), torch {result['machine']['torch']}, "
        f"{result['machine']['date']}. Wall time {result['wall_s']:.0f} s of a {result['budget_s']:.0f} s budget.",
        "",
        f"**Pick:** `{result['best_spec']}` — {result['best_real_tokens_per_s']:,.0f} real tok/s vs "
        f"{result['reference_real_tokens_per_s']:,.0f} for `{result['base']}` (product of kept stage gains "
        f"{result['speedup_estimate']:.2f}x).",
        "",
        f"Parity band (paired: {result.get('parity_band_source', 'reference re-runs')}): allowed gap "
        f"{result['parity_band']:.2%}, would catch a regression >= {_fmt(result.get('parity_detectable_effect'), '.2%')} "
        f"(val losses {', '.join(f'{v:.4f}' for v in result['reference_val_losses'])}); a verdict is "
        f"unjudged, and nothing is kept, when that exceeds {result['method'].get('parity_resolution', 0.01):.0%}.",
        "",
        f"Reproduce side by side: `{result['bench_command']}`",
        "",
        "| stage | candidate | real tok/s | vs best | noise | val loss | parity gap | band | detects | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["candidates"]:
        lines.append(
            f"| {c['stage']} | `{' '.join(c['overrides'])}` | {_fmt(c['real_tokens_per_s'], ',.0f')} | "
            f"{_fmt(c['speed_vs_best'], '.3f')} | {_fmt(c['noise'], '.1%')} | {_fmt(c['val_loss'], '.4f')} | "
            f"{_fmt(c['parity_gap'], '.2%')}{_against(c)} | {_fmt(c.get('parity_band'), '.2%')} | "
            f"{_fmt(c.get('parity_detectable_effect'), '.2%')} | {c['verdict']} |"
        )
    lines += ["", "| stage | outcome |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["stages"].items()]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """recipe.toml (the pick), report.json, report.md, report.html — each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe = resolve_recipe(result["best_spec"])
    paths = {
        "recipe": save_recipe(recipe, out_dir / "recipe.toml"),
        "json": out_dir / "report.json",
        "markdown": out_dir / "report.md",
        "html": out_dir / "report.html",
    }
    atomic_write_text(paths["json"], json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    atomic_write_text(paths["markdown"], md)
    body = _md_to_html(md)
    page = (
        "<!doctype html><meta charset='utf-8'><title>slipstream optimize</title>"
        "<style>body{font:14px system-ui;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px}code{background:#f4f4f4}</style>\n" + body
    )
    atomic_write_text(paths["html"], page)
    return paths


def _inline(text: str) -> str:
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    bold = text.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(bold))


def _md_to_html(md: str) -> str:
    """Just enough Markdown for this report: headings, tables, paragraphs with `code` and **bold**."""
    out, in_table = [], False
    for line in md.splitlines():
        is_row = line.startswith("|")
        if in_table and not is_row:
            out.append("</table>")
        if is_row and not in_table:
            out.append("<table>")
        in_table = is_row
        if line.startswith("|---"):
            continue
        if is_row:
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
        elif line.startswith("# "):
            out.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line:
            out.append(f"<p>{_inline(line)}</p>")
    if in_table:
        out.append("</table>")
    return "\n".join(out)
