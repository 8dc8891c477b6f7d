"""Step accounting with units in every field name.

The loader reports each batch (real and padded tokens, time spent preparing it); `Session.step`
closes the step. Nothing here reads device tensors. On CUDA the end of a step waits for the device
(one `torch.cuda.synchronize` per step): kernels run asynchronously, so without it a step's time
would be the time to *launch* its kernels, and every tokens/s figure would be wrong.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch


@dataclass
class StepRecord:
    step_time_s: float
    data_wait_s: float
    real_tokens: int
    padded_tokens: int
    shape: tuple[int, int] | None


@dataclass
class MetricsSummary:
    steps: int
    real_tokens: int
    padded_tokens: int
    padding_waste: float
    real_tokens_per_s: float
    step_time_s: float
    """Median wall time of a step after the first (the first holds compilation and warm-up)."""
    step_time_iqr_s: float
    first_step_s: float
    data_wait_s: float
    """Total time the training thread waited for batches."""
    distinct_shapes: int
    recompiles: int
    skipped_steps: int
    peak_memory_bytes: int
    peak_memory_kind: str
    device: str
    precision: str
    extra: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes: allocator peak on CUDA, process peak RSS on CPU (which includes everything)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    # Linux keeps ru_maxrss across execve, so a child started by a big parent would report the
    # parent's peak; VmHWM belongs to this process image alone.
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "process_peak_rss"
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"


class MetricsTracker:
    def __init__(self, device: torch.device, precision: str):
        self.device = device
        self.precision = precision
        self.records: list[StepRecord] = []
        self.skipped_steps = 0
        self.extra: dict[str, object] = {}
        self._pending_wait = 0.0
        self._pending_real = 0
        self._pending_padded = 0
        self._pending_shape: tuple[int, int] | None = None
        self._last_step_end: float | None = None
        self._step_start: float | None = None
        self._graphs_after_first_step = 0

    def on_batch(self, batch: object, wait_s: float) -> None:
        # A step starts when its (first) batch is asked for, so time spent between steps on
        # evaluation, logging or checkpoints is not charged to training throughput.
        if self._step_start is None:
            self._step_start = time.perf_counter() - wait_s
        self._pending_wait += wait_s
        self._pending_real += int(getattr(batch, "real_tokens", 0))
        self._pending_padded += int(getattr(batch, "padded_tokens", 0))
        self._pending_shape = getattr(batch, "shape", None)

    def end_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step ends when its kernels have run
        now = time.perf_counter()
        start = self._step_start if self._step_start is not None else self._last_step_end
        if start is None:
            start = now
        self.records.append(
            StepRecord(
                step_time_s=now - start,
                data_wait_s=self._pending_wait,
                real_tokens=self._pending_real,
                padded_tokens=self._pending_padded,
                shape=self._pending_shape,
            )
        )
        if len(self.records) == 1:
            self._graphs_after_first_step = dynamo_graph_count()
        self._last_step_end = now
        self._step_start = None
        self._pending_wait = 0.0
        self._pending_real = self._pending_padded = 0

    def summary(self) -> MetricsSummary:
        recs = self.records
        real = sum(r.real_tokens for r in recs)
        padded = sum(r.padded_tokens for r in recs)
        steady = recs[1:] if len(recs) > 1 else recs
        times = np.array([r.step_time_s for r in steady]) if steady else np.zeros(1)
        steady_time = float(times.sum())
        steady_real = sum(r.real_tokens for r in steady)
        mem, kind = peak_memory(self.device)
        q75, q25 = np.percentile(times, [75, 25])
        return MetricsSummary(
            steps=len(recs),
            real_tokens=real,
            padded_tokens=padded,
            padding_waste=padded / (real + padded) if real + padded else 0.0,
            real_tokens_per_s=steady_real / steady_time if steady_time > 0 else 0.0,
            step_time_s=float(np.median(times)),
            step_time_iqr_s=float(q75 - q25),
            first_step_s=recs[0].step_time_s if recs else 0.0,
            data_wait_s=float(sum(r.data_wait_s for r in recs)),
            distinct_shapes=len({r.shape for r in recs if r.shape is not None}),
            # Graphs dynamo compiled after the first step: each one is a recompilation for a new shape.
            recompiles=max(0, dynamo_graph_count() - self._graphs_after_first_step) if len(recs) > 1 else 0,
            skipped_steps=self.skipped_steps,
            peak_memory_bytes=mem,
            peak_memory_kind=kind,
            device=str(self.device),
            precision=self.precision,
            extra=dict(self.extra),
        )


def dynamo_graph_count() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's own counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0
    return int(counters["stats"].get("unique_graphs", 0))
