"""`slipstream doctor`: what this machine does fast, measured (the machine probe), and what every
`auto` decides from it.

Nothing here is inferred from an ISA name: bf16 "runs" on every CPU torch supports, but its
matmuls are ~75x slower than fp32 on AVX2-only CPUs, ~0.55x on an Intel AVX512-BF16 CPU without
AMX (while a Zen 4 with the same ISA measured ~4.5x) and ~4x faster on AMX CPUs. The report prints the figures and the verdicts `machine` derives from them.
"""

from __future__ import annotations

import platform
import sys
import time
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's marketing name where the OS tells it (Linux), else what platform knows."""
    from .machine import _cpu_identity

    return _cpu_identity()[0]


def machine_info() -> dict[str, Any]:
    """What a benchmark result must carry to be comparable: device, versions, date, load."""
    import datetime
    import os

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0)
        if cuda
        else f"cpu ({platform.processor() or platform.machine()})",
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        "date": datetime.date.today().isoformat(),
        # Other jobs on the machine skew timings; results record how busy it was at the start.
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def diagnose(
    check_compile: bool = True, refresh: bool = False, device: torch.device | str | None = None
) -> dict[str, Any]:
    """The doctor report: versions, the machine probe (from the cache unless `refresh`), a verdict
    per dtype, and the `auto` decisions taken from it. `check_compile=False` skips the
    torch.compile check (a first compile costs 15-25 s on a 2-core CPU) unless it is cached."""
    from . import decisions, machine

    checks = ("compile", "triton") if check_compile else ("triton",)
    t0 = time.perf_counter()
    p = machine.probe(device, refresh=refresh, checks=checks)
    lookup_s = time.perf_counter() - t0
    dev = torch.device(p.device)
    cuda = dev.type == "cuda"
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(dev) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "cpu": p.fingerprint["cpu_model"],
        "cpu_capability": p.fingerprint["cpu_capability"],
    }
    if cuda:
        capability = torch.cuda.get_device_capability(dev)
        report["compute_capability"] = ".".join(map(str, capability))
        report["fp8_supported"] = capability >= (8, 9)
    report["dtypes"] = {}
    for dtype in ("fp32", "bf16", "fp16"):
        pays, verdict = decisions.dtype_verdict(p, dtype)
        ratio, n = p.speed_vs_fp32(dtype)
        report["dtypes"][dtype] = {
            "pays": pays,
            "speed_vs_fp32": ratio,
            "peak_n": n,
            "verdict": verdict,
        }
    report["copy_bytes_per_s"] = dict(p.copy_bytes_per_s)
    report["checks"] = {
        name: {"ok": c.ok, "detail": c.detail, "seconds": c.seconds} for name, c in p.checks.items()
    }
    report["decisions"] = {
        d.field: {"choice": d.choice, "reason": d.reason}
        for d in (decisions.decide_precision(dev, p), decisions.decide_serve_quantize(dev, p))
    }
    report["probe_source"] = "cache" if p.cached else "measured"
    report["probe_s"] = p.probe_s
    report["lookup_s"] = lookup_s
    report["probe_measured_at"] = p.measured_at
    report["probe_cache_file"] = str(machine.cache_path(p.key))
    report["summary"] = decisions.describe(p)
    report["probe"] = p.to_dict()
    return report
