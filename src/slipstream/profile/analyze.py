"""Analysis: a thin facade over one analyzer per finding kind (`findings/`), the tables
(`tables.py`) and source lookup (`source.py`). Each analyzer is a stateless function over a Capture
that returns Findings; nothing here prints or plots (report.py does).

`where` is a `file:line` in the user's code (see source.py). Compilations carry exact call sites
(Python's own stack, taken in dynamo's compile-start callback).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .findings.copies import find_unpinned_copies
from .findings.data import find_data_starvation
from .findings.launches import find_launch_bound
from .findings.optimizer import find_unfused_optimizer
from .findings.padding import find_padding_waste
from .findings.precision import find_fp32_matmuls
from .findings.recompiles import find_recompiles
from .findings.syncs import find_host_syncs
from .records import Capture
from .tables import op_table, overhead, time_breakdown
from .trace import SEVERITY_ORDER, Finding, active_us, step_count

ANALYZERS: tuple[Callable[[Capture], list[Finding]], ...] = (
    find_host_syncs,
    find_data_starvation,
    find_recompiles,
    find_launch_bound,
    find_padding_waste,
    find_fp32_matmuls,
    find_unpinned_copies,
    find_unfused_optimizer,
)


# ----------------------------------------------------------------------------- facade


@dataclass
class ProfileResult:
    findings: list[Finding]
    breakdown: list[dict[str, Any]]
    ops: list[dict[str, Any]]
    overhead: dict[str, Any]
    capture: Capture
    step_time_s: float
    """Mean wall time of a recorded step."""

    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in ("warning", "critical")]

    def to_dict(self) -> dict[str, Any]:
        cap = self.capture
        return {
            "schema": "slipstream.profile/2",
            "source": cap.source,
            "device": cap.device,
            "bf16_pays": cap.bf16_pays,
            "bf16_verdict": cap.bf16_verdict,
            "mode": "light" if cap.light else "full",
            "light_reason": cap.light_reason,
            "schedule": {
                "wait": cap.config.wait,
                "warmup": cap.config.warmup,
                "active": cap.config.active,
                "tail": cap.config.tail,
            },
            "step_source": cap.step_source,
            "steps_run": len(cap.step_times_s),
            "steps_profiled": len(cap.step_windows_us),
            "step_time_s": self.step_time_s,
            "step_times_s": cap.step_times_s,
            "step_phases": cap.step_phases,
            "overhead": self.overhead,
            "breakdown": self.breakdown,
            "findings": [f.to_dict() for f in self.findings],
            "top_ops": self.ops,
            "compiles": [
                {
                    "compile_id": c.compile_id,
                    "step": c.step,
                    "compile_s": c.duration_s,
                    "recompile": c.is_recompile,
                    "call_site": f"{c.call_site[0]}:{c.call_site[1]}" if c.call_site else None,
                }
                for c in cap.compiles
            ],
            "guard_failures": cap.guard_failures,
            "metrics": cap.metrics,
            "trace_path": cap.trace_path,
            "script_exit": cap.script_exit,
        }


def analyze(
    cap: Capture, analyzers: Sequence[Callable[[Capture], list[Finding]]] = ANALYZERS
) -> ProfileResult:
    findings = [f for a in analyzers for f in a(cap)]
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -f.share_of_step))
    return ProfileResult(
        findings=findings,
        breakdown=time_breakdown(cap),
        ops=op_table(cap),
        overhead=overhead(cap),
        capture=cap,
        step_time_s=active_us(cap) / step_count(cap) / 1e6 if cap.step_windows_us else 0.0,
    )
