"""Events out of a finished profiler: each op with its kind, times, shapes and Python stack."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .frames import FRAME_PATTERN, resolve_stack
from .records import Capture, Event


def _kind(evt: Any) -> str:
    if evt.device_type != torch.autograd.DeviceType.CPU:
        return "kernel"
    name = evt.name
    if (
        name.startswith("ProfilerStep")
        or "#" in name
        and name.split("#")[0]
        in (
            "Optimizer.step",
            "Optimizer.zero_grad",
        )
    ):
        return "annotation"
    if name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
        return "runtime"
    if FRAME_PATTERN.match(name) or name.startswith("<built-in") or name.startswith("nn.Module:"):
        return "python"
    if "::" in name:
        return "op"
    return "annotation"


def extract_events(prof: torch.profiler.profile, capture: Capture, search: Sequence[str]) -> None:
    """Normalize the profiler's function events into `capture.events` and its step windows."""
    raw = list(prof.events())
    index = {id(e): i for i, e in enumerate(raw)}
    cache: dict[str, str] = {}
    events = capture.events
    for e in raw:
        parent = getattr(e, "cpu_parent", None)
        kernels = tuple(k.name for k in getattr(e, "kernels", []) or [])
        kind = _kind(e)
        events.append(
            Event(
                # Python events are named by their frame: resolve its path like the stacks'.
                name=resolve_stack([e.name], cache, search)[0] if kind == "python" else e.name,
                start_us=float(e.time_range.start),
                end_us=float(e.time_range.end),
                thread=int(e.thread),
                device="cpu" if e.device_type == torch.autograd.DeviceType.CPU else "cuda",
                kind=kind,
                stack=resolve_stack(e.stack or (), cache, search),
                input_dtypes=tuple(str(d) for d in (getattr(e, "input_dtypes", None) or ())),
                input_shapes=tuple(e.input_shapes or ()),
                parent=index.get(id(parent), -1) if parent is not None else -1,
                kernels=kernels,
            )
        )
    steps = sorted((ev.start_us, ev.end_us) for ev in events if ev.name.startswith("ProfilerStep"))
    capture.step_windows_us = steps
