"""`slipstream doctor`: what this machine can do, each claim checked by running it."""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
from typing import Any

import torch


def _try(fn) -> tuple[bool, str]:
    try:
        return True, str(fn() or "ok")
    except Exception as err:  # doctor reports failures, it never raises them
        return False, f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def _bf16_matmul() -> str:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    (a @ a).float().sum().item()
    return dev


def _fp16_supported() -> str:
    if not torch.cuda.is_available():
        from .precision import cpu_supports_fp16

        if not cpu_supports_fp16():
            raise RuntimeError("this CPU has no fp16 matmuls; use bf16")
        return "cpu: runs (with loss scaling), but slower than fp32 on most CPUs; prefer bf16"
    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    (a @ a).float().sum().item()
    return "cuda"


def _compile_works() -> str:
    t0 = time.perf_counter()
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(16)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2 + 1)
    return f"compiled a function in {time.perf_counter() - t0:.1f} s"


def _triton() -> str:
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("not installed: pip install 'slipstream[gpu]'")
    import triton

    where = "GPU" if torch.cuda.is_available() else "CPU only under TRITON_INTERPRET=1"
    return f"triton {triton.__version__} ({where})"


def cpu_model() -> str:
    """The CPU's marketing name where the OS tells it (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def diagnose(check_compile: bool = True) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if cuda:
        report["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        report["fp8_supported"] = torch.cuda.get_device_capability(0) >= (8, 9)
    checks = {"bf16": _try(_bf16_matmul), "fp16": _try(_fp16_supported), "triton": _try(_triton)}
    if check_compile:
        checks["torch.compile"] = _try(_compile_works)
    report["checks"] = {k: {"ok": ok, "detail": detail} for k, (ok, detail) in checks.items()}
    return report
