"""Steps found without touching the user's loop: a global optimizer step post-hook closes a step
each time the *first* optimizer that stepped steps again, or `mark_step()` does when the loop calls
it (then optimizer steps stop counting). Each boundary advances the profiler's wait / warm-up /
active schedule, so only active steps are recorded and the wait and tail steps give the unprofiled
baseline the overhead is measured against, in the same run."""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..recipe import RecipeError
from .events import extract_events
from .frames import innermost_user_frame
from .records import Capture, CaptureConfig, CompileRecord

# ----------------------------------------------------------------------------- hardware facts


def bf16_verdict(device: str) -> tuple[bool, str]:
    """Whether bf16 matmuls *pay* here, and the measured figures that say so (the machine probe,
    cached per machine): not whether they merely run, which they do everywhere, 75x slower than
    fp32 on AVX2-only CPUs."""
    from .. import decisions, machine

    return decisions.dtype_verdict(machine.probe(device), "bf16")


# ----------------------------------------------------------------------------- steps


class ProfileComplete(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised at a step boundary to end a script once the schedule is done (BaseException, so
    the script's `except Exception` does not swallow it)."""


_ACTIVE: _StepClock | None = None


def mark_step() -> None:
    """Close a training step for `slipstream profile` (a no-op when nothing is profiling).

    Call it once per step where optimizer steps do not delimit steps (gradient accumulation, no
    torch.optim optimizer, several optimizers); after the first call optimizer steps stop counting.
    """
    clock = _ACTIVE
    if clock is not None:
        clock.mark()


class _StepClock:
    """Closes steps: times them, advances the profiler, watches compilations, stops the script."""

    def __init__(
        self,
        cfg: CaptureConfig,
        capture: Capture,
        stop: bool,
        on_trace_ready: Callable[[torch.profiler.profile], None],
    ):
        self.prof: torch.profiler.profile | None = None
        self.on_trace_ready = on_trace_ready
        self.cfg = cfg
        self.capture = capture
        self.stop = stop
        self.steps = 0
        self.first_optimizer: int | None = None
        self.mode = "optimizer"
        self.stepped_since_mark = False
        self.last = time.perf_counter()
        self.compile_started: dict[str, float] = {}
        self.call_sites: dict[str, tuple[str, int, str] | None] = {}
        self.dynamo_hooked = False
        self.failures_before: dict[Any, int] = {}

    # -- step boundaries ------------------------------------------------------------------------

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.mode != "optimizer":
            return
        if self.first_optimizer is None:
            self.first_optimizer = id(optimizer)
        if id(optimizer) != self.first_optimizer:
            return  # a second optimizer in the same step (GAN, separate heads) is not a new step
        self.stepped_since_mark = True
        self.boundary()

    def mark(self) -> None:
        if self.mode == "optimizer":
            self.mode = "mark_step"
            self.capture.step_source = "mark_step"
            if self.stepped_since_mark:
                return  # this step was already closed by its optimizer step
        self.boundary()

    def boundary(self) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.capture.step_times_s.append(now - self.last)
        self.capture.step_phases.append(self.cfg.phase(self.steps))
        self.hook_dynamo()
        t0 = time.perf_counter()
        if self.prof is not None:
            self.prof.step()  # may process the recorded steps (on_trace_ready): not charged to a step
        elif self.steps == self.cfg.wait:
            self.start_profiler()
        self.last = time.perf_counter()
        if self.last - t0 > 0.05:
            self.capture.postprocess_s += self.last - t0
        if self.stop and self.steps >= self.cfg.total_steps:
            raise ProfileComplete

    def start_profiler(self) -> None:
        """Start torch.profiler for the warm-up and active steps (the wait steps ran without it).

        Python stacks trace every call the compiler makes: a run still recompiling after its first
        step would spend minutes in dynamo under the tracer, so it is profiled in light mode."""
        full = not self.cfg.light
        # Recompiling in the last wait step (not just once early, as automatic dynamic shapes do).
        if full and any(c.is_recompile and 2 < c.step == self.steps for c in self.capture.compiles):
            full = False
            self.capture.light_reason = "still recompiling during the wait steps"
        self.capture.light = not full
        self.prof = make_profiler(
            light=not full,
            device=self.capture.device,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.cfg.warmup, active=self.cfg.active, repeat=1
            ),
            on_trace_ready=self.on_trace_ready,
        )
        self.prof.start()

    # -- compilations ---------------------------------------------------------------------------

    def hook_dynamo(self) -> None:
        """Watch dynamo once something imported it (importing it ourselves costs seconds)."""
        if self.dynamo_hooked or "torch._dynamo" not in sys.modules:
            return
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import guard_failures

        callback_handler.register_start_callback(self.on_compile_start)
        callback_handler.register_end_callback(self.on_compile_end)
        self.failures_before = {code: len(r) for code, r in guard_failures.items()}
        self.dynamo_hooked = True

    def unhook_dynamo(self) -> None:
        if not self.dynamo_hooked:
            return
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import guard_failures

        with contextlib.suppress(ValueError):
            callback_handler.remove_start_callback(self.on_compile_start)
        with contextlib.suppress(ValueError):
            callback_handler.remove_end_callback(self.on_compile_end)
        for code, reasons in list(guard_failures.items()):
            for reason in reasons[self.failures_before.get(code, 0) :]:
                where = f"{code.co_filename}:{code.co_firstlineno} ({code.co_name})"
                self.capture.guard_failures.append({"code": where, "reason": str(reason).split("\n")[0]})
        self.dynamo_hooked = False

    def on_compile_start(self, args: Any) -> None:
        cid = str(args.compile_id)
        self.compile_started[cid] = time.perf_counter()
        self.call_sites[cid] = innermost_user_frame(traceback.extract_stack(), self.capture.own_code_is_user)

    def on_compile_end(self, args: Any) -> None:
        cid = str(args.compile_id)
        start = self.compile_started.pop(cid, None)
        if start is None:
            return
        self.capture.compiles.append(
            CompileRecord(
                compile_id=cid,
                step=self.steps + 1,
                duration_s=time.perf_counter() - start,
                call_site=self.call_sites.pop(cid, None),
            )
        )


def make_profiler(
    *,
    light: bool,
    device: str,
    schedule: Callable[[int], Any],
    on_trace_ready: Callable[[torch.profiler.profile], None] | None = None,
) -> torch.profiler.profile:
    """The profiler a capture runs: full (shapes, Python stacks kept on every op) or light."""
    from torch._C._profiler import _ExperimentalConfig

    full = not light
    return torch.profiler.profile(
        activities=_activities(device),
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=full,
        with_stack=full,
        # verbose: keep each op's Python stack in the events (not only in the trace)
        experimental_config=_ExperimentalConfig(verbose=full, enable_cuda_sync_events=device == "cuda"),
    )


def _activities(device: str) -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


@contextlib.contextmanager
def capturing(
    cfg: CaptureConfig,
    capture: Capture,
    *,
    stop_when_done: bool,
    path_search: Callable[[], Sequence[str]] = lambda: sys.path,
) -> Iterator[_StepClock]:
    """Profile whatever runs inside: steps close at optimizer steps or `mark_step()`."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RecipeError("slipstream profile is already capturing in this process; profiles do not nest")

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        if cfg.trace_path:
            Path(cfg.trace_path).parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(cfg.trace_path)
            capture.trace_path = cfg.trace_path
        extract_events(prof, capture, path_search())

    clock = _StepClock(cfg, capture, stop_when_done, on_trace_ready)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(clock.on_optimizer_step)
    _ACTIVE = clock
    clock.hook_dynamo()
    if cfg.wait == 0:
        clock.start_profiler()
    clock.last = time.perf_counter()
    try:
        yield clock
    finally:
        _ACTIVE = None
        handle.remove()
        try:
            if clock.prof is not None:
                t0 = time.perf_counter()
                clock.prof.stop()  # processes a cycle cut short by the end of the run
                capture.postprocess_s += time.perf_counter() - t0
        finally:
            clock.unhook_dynamo()


def capture_active() -> bool:
    """Whether a capture is running in this process (a finished or failed one leaves none)."""
    return _ACTIVE is not None
