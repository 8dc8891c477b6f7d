"""`slipstream profile`: where a training step's time goes, at which line, and the fix.

    from slipstream.profile import profile_script, profile_workload
    result = profile_workload("gpt-stdlib", "baseline")
    for finding in result.findings: ...

`mark_step()` closes a step when a loop's steps are not delimited by optimizer steps.
"""

from .analyze import ANALYZERS, Finding, ProfileResult, analyze, op_table, overhead, time_breakdown
from .capture import capture_script, capture_workload
from .records import Capture, CaptureConfig
from .steps import mark_step


def profile_workload(
    workload: str = "gpt-stdlib",
    recipe: object = "baseline",
    *,
    size: str = "tiny",
    config: CaptureConfig | None = None,
) -> ProfileResult:
    """Profile the built-in training loop and analyse it."""
    return analyze(capture_workload(workload, recipe, size=size, config=config))


def profile_script(command: list[str], *, config: CaptureConfig | None = None) -> ProfileResult:
    """Run `python script.py args` in this process under the profiler and analyse it."""
    return analyze(capture_script(command, config=config))


__all__ = [
    "ANALYZERS",
    "Capture",
    "CaptureConfig",
    "Finding",
    "ProfileResult",
    "analyze",
    "capture_script",
    "capture_workload",
    "mark_step",
    "op_table",
    "overhead",
    "profile_script",
    "profile_workload",
    "time_breakdown",
]
