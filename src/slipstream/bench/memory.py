"""Peak memory of each contender: on CUDA measured in the shared process per round, on CPU as the
peak RSS of a short run alone in a subprocess (RSS is per process)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch


class CudaMemory:
    """Each recipe's CUDA peak as if it had run alone, though every contender shares this process.

    All contenders' tensors stay allocated while any one of them runs, so the allocator's peak during
    a round counts them all. Per contender: the bytes it keeps (allocated while it was built and
    warmed up: weights, optimizer state, CUDA graph pools, prefetched batches) plus the most any of
    its rounds allocated above what was allocated when the round began (activations, gradients,
    temporaries), with the allocator's peak reset before each round. Does nothing off CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on = device.type == "cuda"
        self.kept: dict[str, int] = {}
        self.above: dict[str, int] = {}

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.on else 0

    def keep(self, name: str, since: int) -> None:
        """Charge to `name` what was allocated since `allocated()` returned `since`."""
        if self.on:
            self.kept[name] = self.kept.get(name, 0) + max(0, self.allocated() - since)

    @contextlib.contextmanager
    def round(self, name: str):
        start = self.allocated()
        if self.on:
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if self.on:
            above = int(torch.cuda.max_memory_allocated(self.device)) - start
            self.above[name] = max(self.above.get(name, 0), above)

    def peak(self, name: str) -> int | None:
        return self.kept.get(name, 0) + self.above[name] if name in self.above else None


def peak_memory_in_subprocess(spec: str, workload: str, size: str, steps: int = 2) -> tuple[int | None, str]:
    """Process peak RSS of a short run of this recipe alone (RSS is per process, so one each)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "slipstream.cli", "train", "--workload", workload, "--size", size]
        cmd += ["--recipe", spec, "--steps", str(steps), "--eval-every", "0", "--no-progress", "--json", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None, "memory run timed out"
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            return None, f"memory run failed: {last}"
        with open(out) as fh:
            data = json.load(fh)
    return int(data["peak_memory_bytes"]), f"{data['peak_memory_kind']} of a {steps}-step run alone"
