"""The machine probe: what this machine measured (its decisions are in `decisions.py`).

This project's own hosts range from AVX2-only CPUs (bf16 matmuls ~75x slower than fp32: oneDNN has
no bf16 kernel there and falls back to a reference loop) through an Intel AVX512-BF16 CPU without AMX
(bf16 ~0.55x fp32, while a Zen 4 with the same ISA measured ~4.5x) to AMX CPUs (bf16 ~4x) and GPUs.
No flag or ISA name predicts which, so every `auto` reads a measurement taken here:

- `probe()` measures matmul throughput per dtype at a few sizes, host copy bandwidth (and H2D/D2H,
  pinned and pageable, on CUDA), and, on request, whether torch.compile and Triton code generation
  work. It runs once per machine *fingerprint* (CPU model and flags, the kernel-selecting
  environment, GPU, torch version, thread count) and is cached as JSON in slipstream's cache folder.
- `decisions.py` turns the figures into a `Decision` (choice + one-line reason). Session, bench,
  the peers, doctor, profile and serve all ask there instead of deciding on their own.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

PROBE_VERSION = 1
"""Bump when what the probe measures changes: old cache files are then ignored."""

MATMUL_SIZES = (256, 512, 1024)
"""Square matmul sizes measured per dtype: the hidden sizes of the models we train on CPUs."""

CUDA_MATMUL_SIZES = (1024, 2048, 4096, 8192)
"""The sizes on a GPU, whose tensor cores reach their peak only on large matmuls (a 1024^2 one is far
below it: as the MFU denominator it would inflate MFU). The best over these is the peak."""


def matmul_sizes(device: torch.device) -> tuple[int, ...]:
    return CUDA_MATMUL_SIZES if device.type == "cuda" else MATMUL_SIZES


MATMUL_SECONDS = 0.12
"""Time spent timing one (dtype, size) pair; the first call is a warm-up outside it."""

SLOW_CALL_S = 0.25
"""A next-size matmul predicted slower than this stops the larger sizes of that dtype (an unaccelerated bf16
1024^2 matmul takes ~3 s on an AVX2 CPU; measuring it would blow the probe's time budget)."""

BUSY_LOAD_PER_THREAD = 0.5
"""A load average above this per probe thread means the figures were taken on a busy machine."""

# Environment variables that change which CPU kernels torch and oneDNN run (and so the figures).
_KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
# tf32: fp32 tensors with torch.backends.cuda.matmul.allow_tf32 on (CUDA only)


# ----------------------------------------------------------------------------- what is measured


@dataclass
class Check:
    """Whether something works here, how long checking took, and what was seen."""

    ok: bool
    detail: str
    seconds: float = 0.0


@dataclass
class MachineProbe:
    fingerprint: dict[str, Any]
    """What the figures depend on; a change in any field means a new probe."""
    key: str
    """Short hash of the fingerprint (the cache file name)."""
    device: str
    """"cpu" or "cuda" (the device the figures were measured on)."""
    matmul_flops_per_s: dict[str, dict[str, float]]
    """dtype -> {size n (as a string, JSON keys): FLOP/s of an n x n x n matmul}. A dtype absent
    from a size was too slow to measure there (see matmul_notes)."""
    matmul_notes: dict[str, str]
    """dtype -> why it was not measured (unsupported, or too slow for the larger sizes)."""
    copy_bytes_per_s: dict[str, float]
    """host_memcpy always; on CUDA h2d_pinned, h2d_pageable, d2h_pinned, d2h_pageable."""
    checks: dict[str, Check] = field(default_factory=dict)
    """Optional checks measured on request (compile, triton), cached beside the figures."""
    measured_at: str = ""
    probe_s: float = 0.0
    """Seconds the measurement took (cold), not counting checks."""
    version: int = PROBE_VERSION
    load_average_1m: float | None = None
    """The host's 1-minute load average when the figures were taken: other jobs on a 2-core
    machine skew them (describe() then says to re-measure with --refresh)."""
    cached: bool = False
    """True when read back from the cache file rather than measured by this process (not saved:
    the file always says False)."""

    # -- reading the figures ----------------------------------------------------------------------

    def flops(self, dtype: str, n: int | None = None) -> float | None:
        """FLOP/s of `dtype` at size n (its best over the sizes measured when n is None)."""
        table = self.matmul_flops_per_s.get(dtype, {})
        if not table:
            return None
        if n is None:
            return max(table.values())
        return table.get(str(n))

    def speed_vs_fp32(self, dtype: str) -> tuple[float | None, int | None]:
        """(ratio of this dtype's best matmul rate to fp32's best, the size of that best).

        Peaks rather than one size: a single (dtype, size) timing on a shared machine can be off by
        30%, the best over sizes much less. A dtype too slow to reach the larger sizes still has its
        peak among the sizes it did reach."""
        mine = self.matmul_flops_per_s.get(dtype, {})
        ref = self.matmul_flops_per_s.get("fp32", {})
        if not mine or not ref:
            return None, None
        n, best = max(mine.items(), key=lambda kv: kv[1])
        return best / max(ref.values()), int(n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineProbe:
        data = dict(data)
        data["checks"] = {k: Check(**v) for k, v in dict(data.get("checks", {})).items()}
        return cls(**data)


# ----------------------------------------------------------------------------- fingerprint & cache


@functools.cache
def _cpu_identity() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; platform's answer elsewhere. Read once per process:
    probe() fingerprints the machine on every call, and the CPU does not change under a process."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def fingerprint(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Everything the probe's figures depend on."""
    device = torch.device(device)
    model, flags = _cpu_identity()
    fp: dict[str, Any] = {
        "cpu_model": model,
        "cpu_flags_sha": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in _KERNEL_ENV if k in os.environ},
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fp["gpu"] = props.name
        fp["gpu_capability"] = f"{props.major}.{props.minor}"
        fp["cuda"] = torch.version.cuda
        fp["matmul_sizes"] = list(CUDA_MATMUL_SIZES)  # a probe from the 1024^2-only days is stale
    return fp


def fingerprint_key(fp: dict[str, Any]) -> str:
    text = json.dumps({"v": PROBE_VERSION, **fp}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """slipstream's cache folder: $SLIPSTREAM_CACHE, else $XDG_CACHE_HOME/slipstream, else
    ~/.cache/slipstream (the corpus cache lives there too)."""
    from .workloads.corpus import default_cache_dir

    return default_cache_dir()


def cache_path(key: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / "machine" / f"probe-{key}.json"


def _load_cached(path: Path, key: str) -> MachineProbe | None:
    try:
        data = json.loads(path.read_text())
        probe = MachineProbe.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent, half-written by an older version, or edited by hand: measure again
    if probe.version != PROBE_VERSION or probe.key != key:
        return None
    probe.cached = True
    return probe


def _save(probe: MachineProbe, path: Path) -> None:
    from .files import atomic_write_text

    data = {**probe.to_dict(), "cached": False}
    try:
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError:
        pass  # a read-only cache folder costs a re-probe next time, never the run


# ----------------------------------------------------------------------------- measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dtype_runs(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when a matmul in `dtype` runs on `device`, else why not."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            return "no native bf16 on this GPU (compute capability < 8.0)"
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as err:
        return f"matmul fails: {str(err).splitlines()[0][:120]}"
    return None


def measure_matmul(
    device: torch.device, dtypes: tuple[str, ...], sizes: tuple[int, ...] = MATMUL_SIZES
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """FLOP/s per dtype and size: a warm-up call, then as many calls as fit in MATMUL_SECONDS."""
    flops: dict[str, dict[str, float]] = {}
    notes: dict[str, str] = {}
    for name in dtypes:
        dtype = _DTYPES[name]
        why = _dtype_runs(dtype, device)
        if why:
            notes[name] = why
            continue
        if name == "tf32" and device.type != "cuda":
            notes[name] = "TF32 is a CUDA tensor-core mode"
            continue
        tf32_before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"  # fp32 is measured as plain fp32
        try:
            table = _time_sizes(device, dtype, sizes, name, notes)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before
        flops[name] = table
    return flops, notes


def _time_sizes(device, dtype, sizes, name, notes) -> dict[str, float]:
    """FLOP/s per size for one dtype; a size predicted too slow ends the table (with a note)."""
    table: dict[str, float] = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        first = time.perf_counter() - t0
        calls, t0 = 0, time.perf_counter()
        while True:
            a @ b
            calls += 1
            if calls % 4 == 0 or first > MATMUL_SECONDS / 4:
                _sync(device)
                if time.perf_counter() - t0 >= MATMUL_SECONDS:
                    break
        _sync(device)
        per_call = (time.perf_counter() - t0) / calls
        table[str(n)] = 2 * n**3 / per_call
        # The next size costs ~(n'/n)^3 more per call. Both the warm-up and the timed calls must
        # predict a slow one: a single stall of a busy host (spinning OpenMP threads on shared
        # cores) must not cut the larger sizes of a fast dtype.
        grow = (sizes[sizes.index(n) + 1] / n) ** 3 if n != sizes[-1] else 1.0
        if min(first, per_call) * grow > SLOW_CALL_S:
            notes[name] = (
                f"{per_call:.3f} s per {n}^2 matmul: larger sizes not measured "
                f"(~{per_call * grow:.1f} s per call predicted)"
            )
            break
    return table


def measure_copy(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 3) -> dict[str, float]:
    """Best-of-N bytes/s: host memcpy; on CUDA, host<->device with pinned and pageable memory."""
    out: dict[str, float] = {}
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        t = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            t = min(t, time.perf_counter() - t0)
        return nbytes / t

    out["host_memcpy"] = best(lambda: dst.copy_(src))
    if device.type == "cuda":
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["h2d_pinned"] = best(lambda: on_dev.copy_(pinned, non_blocking=True))
        out["h2d_pageable"] = best(lambda: on_dev.copy_(src))
        out["d2h_pinned"] = best(lambda: pinned.copy_(on_dev, non_blocking=True))
        out["d2h_pageable"] = best(lambda: dst.copy_(on_dev))
    return out


_COMPILE_SNIPPET = """
import time, torch
t0 = time.perf_counter()
fn = torch.compile(lambda x: torch.sin(x) * 2 + 1)
x = torch.randn(16)
torch.testing.assert_close(fn(x), torch.sin(x) * 2 + 1)
print(f"{time.perf_counter() - t0:.2f}")
"""


def check_compile(timeout_s: float = 300.0) -> Check:
    """torch.compile (inductor) builds and runs a function. Run in a child process: a first compile
    costs 15-25 s on a 2-core CPU, and a broken C++ toolchain must not take this process down."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _COMPILE_SNIPPET], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return Check(False, f"no result within {timeout_s:.0f} s", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1][:200]
        return Check(False, f"torch.compile failed: {last}", seconds)
    return Check(True, f"compiled and ran a function in {proc.stdout.strip()} s (first compile)", seconds)


def check_triton(device: torch.device) -> Check:
    """Triton generates and launches a kernel on this GPU; on a CPU it can only interpret."""
    t0 = time.perf_counter()
    if importlib.util.find_spec("triton") is None:
        return Check(False, "not installed: pip install 'slipstream[kernels]'")
    import triton

    if device.type != "cuda":
        return Check(False, f"triton {triton.__version__}: no GPU, so no code generation (interpreter only)")
    try:
        from .kernels.activations import gelu_tanh  # a real slipstream kernel, not a toy

        x = torch.randn(1024, device=device)
        y = gelu_tanh(x, backend="triton")
        torch.testing.assert_close(y, torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-5, rtol=1e-5)
    except Exception as err:  # the probe reports what failed, it never raises it
        return Check(
            False, f"triton kernel failed: {type(err).__name__}: {err}"[:200], time.perf_counter() - t0
        )
    return Check(True, f"triton {triton.__version__} generated and ran a kernel", time.perf_counter() - t0)


# ----------------------------------------------------------------------------- the probe


_MEMO: dict[str, MachineProbe] = {}


def probe(
    device: torch.device | str | None = None,
    *,
    refresh: bool = False,
    checks: tuple[str, ...] = (),
    folder: Path | None = None,
) -> MachineProbe:
    """This machine's figures: from the in-process memo, else the cache file, else measured now.

    `checks` adds the slower optional checks ("compile", "triton") if the cached probe lacks them.
    `refresh` measures everything again (and rewrites the cache)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fp = fingerprint(device)
    key = fingerprint_key(fp)
    path = cache_path(key, folder)
    result = None if refresh else (_MEMO.get(str(path)) or _load_cached(path, key))
    dirty = False
    if result is None:
        t0 = time.perf_counter()
        dtypes = ("fp32", "bf16", "fp16") + (("tf32",) if device.type == "cuda" else ())
        flops, notes = measure_matmul(device, dtypes, matmul_sizes(device))
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            notes.setdefault("fp8", "fp8 runs through torchao's float8 training layers; see precision")
        result = MachineProbe(
            fingerprint=fp,
            key=key,
            device=device.type,
            matmul_flops_per_s=flops,
            matmul_notes=notes,
            copy_bytes_per_s=measure_copy(device),
            measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
        )
        result.probe_s = time.perf_counter() - t0
        result.load_average_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        dirty = True
    for name in checks:
        if name in result.checks:
            continue
        if name == "compile":
            result.checks[name] = check_compile()
        elif name == "triton":
            result.checks[name] = check_triton(device)
        else:
            raise ValueError(f"unknown probe check {name!r}; known: compile, triton")
        dirty = True
    if dirty:
        _save(result, path)
    _MEMO[str(path)] = result
    return result


__all__ = [
    "BUSY_LOAD_PER_THREAD",
    "Check",
    "MachineProbe",
    "cache_dir",
    "fingerprint",
    "probe",
]
