"""``compile.mode=auto``: compile only where a timed step says it pays, with graphs where the step
is launch-bound.

On the first H200 run a small model's steps were launch- and host-bound (the GPU >= 96% idle), and
the suite's compiled recipe ran at 0.56x eager on GPT-2: neither "always compile" nor "never" is
right. So on CUDA one eager step is timed and profiled: the GPU busy share is the kernels' time over
the step's wall time. A launch-bound step (busy < ``LAUNCH_BOUND_BUSY``) tries ``reduce-overhead``
(inductor with CUDA graphs: one launch per step), a busy one ``default``; the compiled model is kept
only when its step is at least ``COMPILE_GAIN`` faster. The rule is pure arithmetic over figures
(``choose_compile``), so tests feed them; ``measure_compile`` takes them on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from .decisions import Decision

LAUNCH_BOUND_BUSY = 0.8
"""Below this share of the step's wall time spent in kernels, the step is launch-bound."""

COMPILE_GAIN = 1.05
"""A compiled step must be at least this much faster than eager to be kept."""


def mode_to_try(busy_share: float | None) -> str:
    """reduce-overhead for a launch-bound step (CUDA graphs remove the launches), else default."""
    return "reduce-overhead" if busy_share is not None and busy_share < LAUNCH_BOUND_BUSY else "default"


def choose_compile(eager_s: float, busy_share: float | None, compiled: dict[str, float | str]) -> Decision:
    """The verdict from the figures: ``compiled`` maps a mode to its step seconds, or to why it failed."""
    busy = "not profiled" if busy_share is None else f"GPU busy {busy_share:.0%} of the step"
    bound = "" if busy_share is None else (" (launch-bound)" if busy_share < LAUNCH_BOUND_BUSY else " (busy)")
    parts = [f"eager {eager_s * 1e3:.2f} ms/step, {busy}{bound}"]
    best, best_s = "off", eager_s
    for mode, value in compiled.items():
        if isinstance(value, str):
            parts.append(f"{mode} failed: {value}")
            continue
        parts.append(f"{mode} {value * 1e3:.2f} ms/step ({eager_s / value:.2f}x)")
        if value * COMPILE_GAIN <= eager_s and value < best_s:
            best, best_s = mode, value
    if best == "off" and any(not isinstance(v, str) for v in compiled.values()):
        parts.append(f"kept eager (compile needs >= {COMPILE_GAIN:.2f}x)")
    return Decision("compile.mode", best, "; ".join(parts))


def _step_seconds(step: Callable[[], None], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def busy_share(step: Callable[[], None], device: torch.device) -> float | None:
    """Kernel time over wall time of one step, from torch's profiler (None where it reports none)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    kernel_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
    return min(1.0, kernel_us / 1e6 / wall) if kernel_us and wall > 0 else None


def measure_compile(
    model: nn.Module, step_of: Callable[[nn.Module], Callable[[], None]], device: torch.device
) -> Decision:
    """Time eager, profile its busy share, compile the model in place in the mode that suits it,
    time that, and undo the compile unless it won. ``step_of(model)`` gives one forward+backward."""
    eager = step_of(model)
    eager_s = _step_seconds(eager, device, warmup=2, reps=5)
    try:
        share = busy_share(eager, device)
    except Exception:  # a profiler that cannot run here leaves the choice to the default mode
        share = None
    mode = mode_to_try(share)
    figures: dict[str, float | str] = {}
    try:
        model.compile(mode=mode)
        figures[mode] = _step_seconds(step_of(model), device, warmup=3, reps=5)
    except Exception as err:
        figures[mode] = f"{type(err).__name__}: {str(err)[:120]}"
    finally:
        model._compiled_call_impl = None  # back to eager; the session compiles again if it won
        model.zero_grad(set_to_none=True)
    return choose_compile(eager_s, share, figures)
