"""Padding waste: positions computed for padding."""

from __future__ import annotations

from ..records import Capture
from ..trace import Finding, severity_for


def find_padding_waste(cap: Capture) -> list[Finding]:
    """Compute spent on padding tokens (built-in loop: from the loader's accounting)."""
    waste = float((cap.metrics or {}).get("padding_waste", 0.0) or 0.0)
    sev = severity_for(waste, warn=0.25, critical=0.6, info=0.1)
    if sev is None:
        return []
    return [
        Finding(
            kind="padding_waste",
            severity=sev,
            share_of_step=waste,
            where=None,
            fix="recipe shapes.mode=bucket (pad to planned length buckets) or shapes.mode=pack "
            "(documents packed into full rows)",
            title=f"padding waste: {waste:.0%} of tokens are padding",
            detail="every padded position costs the same compute as a real one",
            evidence={
                "padding_waste": waste,
                "padded_tokens": (cap.metrics or {}).get("padded_tokens"),
                "real_tokens": (cap.metrics or {}).get("real_tokens"),
            },
        )
    ]
