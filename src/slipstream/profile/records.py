"""What a capture keeps: its configuration, and plain data for the analyzers (events with their
Python stacks, step windows and wall times, compilations and guard failures)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..recipe import RecipeError

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class CaptureConfig:
    wait: int = 3
    """Unprofiled steps first (the first one holds warm-up and compilation); the baseline for overhead."""

    warmup: int = 1
    """Steps the profiler runs but discards (its own start-up cost lands here)."""

    active: int = 3
    """Steps recorded and analysed."""

    tail: int = 3
    """Unprofiled steps after the active ones: more baseline for the overhead figure."""

    light: bool = False
    """Light mode: no Python stacks and no input shapes/dtypes. Much less overhead, but findings
    have no `where` and the dtype-based ones (fp32 matmuls, boolean masks by dtype) are skipped."""

    trace_path: str | None = None
    """Write the active steps as a Chrome/Perfetto trace (JSON) here."""

    stop_when_done: bool = True
    """Scripts only: end the script (a BaseException raised at a step boundary) once the schedule
    and the tail steps are done, instead of training to the end."""

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active", "tail"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RecipeError(f"profile {name}={value!r} must be an integer >= 0")
        if self.active < 1:
            raise RecipeError(f"profile active={self.active} must be at least 1")

    @property
    def total_steps(self) -> int:
        return self.wait + self.warmup + self.active + self.tail

    def phase(self, step: int) -> str:
        """Phase of 1-based step `step`: wait, warmup, active or tail."""
        if step <= self.wait:
            return "wait"
        if step <= self.wait + self.warmup:
            return "warmup"
        if step <= self.wait + self.warmup + self.active:
            return "active"
        return "tail"


# ----------------------------------------------------------------------------- captured data


@dataclass
class Event:
    """One profiler event, normalized. Times in microseconds from the profiler's start."""

    name: str
    start_us: float
    end_us: float
    thread: int
    device: str
    """cpu (host events: ops, annotations, Python calls, runtime calls) or cuda (kernels, memcpy)."""
    kind: str
    """op (aten:: and other dispatcher ops), python (a Python call), annotation (record_function,
    ProfilerStep#), runtime (cudaLaunchKernel, cudaStreamSynchronize ...) or kernel (on the device)."""
    stack: tuple[str, ...] = ()
    """Python frames, innermost first, as `path(line): function` (empty in light mode)."""
    input_dtypes: tuple[str, ...] = ()
    input_shapes: tuple[Any, ...] = ()
    parent: int = -1
    """Index of the enclosing host event, -1 at the top."""
    kernels: tuple[str, ...] = ()
    """Device activity this host event launched (kernel and memcpy names)."""

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class CompileRecord:
    """One torch.compile (dynamo) compilation seen during the capture."""

    compile_id: str
    step: int
    """The step it happened in (1-based)."""
    duration_s: float
    call_site: tuple[str, int, str] | None
    """(file, line, function) of the innermost user frame that called the compiled code."""

    @property
    def is_recompile(self) -> bool:
        """Frame compile id > 0: the same frame compiled again (a guard failed)."""
        m = re.match(r"^!?(?:\d+/)?\d+/(\d+)", self.compile_id)
        return bool(m and int(m.group(1)) > 0)


@dataclass
class Capture:
    """Everything one profiled run produced, as plain data."""

    config: CaptureConfig
    source: dict[str, Any]
    """What ran: {"workload": ..., "recipe": ..., "size": ...} or {"script": ..., "argv": [...]}."""
    device: str
    bf16_pays: bool
    """bf16 matmuls measured faster than fp32 here (machine probe, by PAYS_RATIO); merely running
    is not enough: on an Intel AVX512-BF16 CPU without AMX they run at ~0.55x fp32."""
    bf16_verdict: str = ""
    """The probe's figures behind bf16_pays ("bf16 66.0 GFLOP/s vs fp32 119.0 GFLOP/s at ...")."""
    events: list[Event] = field(default_factory=list)
    step_windows_us: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each recorded step, from the profiler's ProfilerStep# events."""
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of every step, profiled or not (the profiler's own step handling excluded)."""
    step_phases: list[str] = field(default_factory=list)
    step_source: str = "optimizer"
    """What closed the steps: optimizer (a step post-hook) or mark_step."""
    compiles: list[CompileRecord] = field(default_factory=list)
    guard_failures: list[dict[str, str]] = field(default_factory=list)
    """Dynamo guard failures during the capture: {"code": file:line (function), "reason": ...}."""
    metrics: dict[str, Any] | None = None
    """The built-in loop's MetricsSummary (padding waste, data wait ...); None for scripts."""
    user_code: str = "outside torch, slipstream and the standard library"
    own_code_is_user: bool = False
    """True when profiling a built-in workload: slipstream's own loop is the code to point at."""
    trace_path: str | None = None
    postprocess_s: float = 0.0
    """Time the profiler took to process the recorded steps (not charged to any step)."""
    light: bool = False
    """Whether the profiled steps ran in light mode (asked for, or chosen: see light_reason)."""
    light_reason: str | None = None
    script_exit: str | None = None
    """How the script ended: None (ran to the end), 'stopped' (after the schedule), or an error."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("events")
        return d
