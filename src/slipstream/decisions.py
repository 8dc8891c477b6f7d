"""The one place that turns the machine probe's figures into decisions: a `Decision` (choice and
one-line reason) for every `auto` that depends on how fast this machine runs a dtype.

The probe is read through `machine.probe` at call time (not imported by name), so a test that
feeds a probe by patching `machine.probe` reaches every decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import machine
from .errors import RecipeError
from .machine import BUSY_LOAD_PER_THREAD, MachineProbe

PAYS_RATIO = 1.15
"""A cheaper dtype is chosen only when its matmuls run at least this much faster than fp32's.
Autocast adds casts and keeps softmax, norms and the loss in fp32, so a dtype whose matmuls are
barely faster does not make the step faster."""


@dataclass(frozen=True)
class Decision:
    """One `auto` turned into a choice, with the measurement that decided it."""

    field: str
    choice: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"field": self.field, "choice": self.choice, "reason": self.reason}


def _gflops(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e9:,.1f} GFLOP/s"


def dtype_verdict(p: MachineProbe, dtype: str) -> tuple[bool, str]:
    """Whether `dtype` pays over fp32 here, and the figures that say so (doctor prints this)."""
    if dtype == "fp32":
        return True, f"fp32 {_gflops(p.flops('fp32'))}: the reference"
    if dtype not in p.matmul_flops_per_s:
        return False, f"{dtype}: {p.matmul_notes.get(dtype, 'not measured')}: not used"
    ratio, n = p.speed_vs_fp32(dtype)
    if ratio is None:
        return False, f"{dtype}: no size measured in both dtypes: not used"
    pays = ratio >= PAYS_RATIO
    verdict = "used by auto" if pays else f"not used (needs >= {PAYS_RATIO:.2f}x)"
    if pays and dtype != "bf16" and p.device != "cuda":
        verdict = "faster, but auto picks fp16 on CUDA only (it needs loss scaling)"
    # The ratio is peak against peak (speed_vs_fp32): print those two figures and their sizes.
    ref = p.matmul_flops_per_s["fp32"]
    ref_n = int(max(ref, key=lambda k: ref[k]))
    where = f"at {n}^2" if ref_n == n else f"(at {n}^2 vs {ref_n}^2)"
    return pays, (
        f"{dtype} {_gflops(p.flops(dtype, n))} vs fp32 {_gflops(p.flops('fp32'))} "
        f"{where} ({ratio:.2f}x): {verdict}"
    )


def bf16_pays(device: torch.device | str | None = None, p: MachineProbe | None = None) -> bool:
    """True where bf16 matmuls measured faster than fp32 by PAYS_RATIO on this machine."""
    p = p or machine.probe(device)
    return dtype_verdict(p, "bf16")[0]


def too_slow(p: MachineProbe, dtype: str, min_speed: float) -> str | None:
    """Why `dtype` is not worth running here — its best matmul rate is below `min_speed` x fp32's —
    with the probe's figures (None: worth it). bench skips contenders and optimize candidates by it."""
    ratio, _ = p.speed_vs_fp32(dtype)
    if ratio is not None and ratio >= min_speed:
        return None
    return dtype_verdict(p, dtype)[1]


def decide_precision(device: torch.device | str, p: MachineProbe | None = None) -> Decision:
    """precision.dtype=auto: the cheapest dtype whose matmuls measured faster than fp32 here.

    fp16 is considered on CUDA only (it needs loss scaling; on CPUs it has never measured faster
    than bf16 where either pays). fp8 is never chosen by auto: it changes numerics enough that it
    should be asked for (and checked by the parity guard)."""
    device = torch.device(device)
    p = p or machine.probe(device)
    candidates = ("bf16", "fp16") if device.type == "cuda" else ("bf16",)
    lines = []
    for dtype in candidates:
        pays, line = dtype_verdict(p, dtype)
        lines.append(line)
        if pays:
            return Decision("precision.dtype", dtype, line)
    return Decision("precision.dtype", "fp32", "; ".join(lines))


def decide_tf32(
    requested: str, device: torch.device | str, dtype: str, p: MachineProbe | None = None
) -> Decision:
    """precision.tf32: whether fp32 matmuls run as TF32 on tensor cores. `on` is refused off CUDA;
    `auto` turns it on only for fp32 compute on CUDA where the probe measured TF32 matmuls at least
    PAYS_RATIO x plain fp32's (a cached probe from before TF32 was measured says to refresh)."""
    device = torch.device(device)
    if requested == "off":
        return Decision("precision.tf32", "off", "off: plain fp32 matmuls (torch's default)")
    if device.type != "cuda":
        if requested == "on":
            raise RecipeError(
                f"precision.tf32=on needs a CUDA device (this run is on {device.type}); use off or auto"
            )
        return Decision("precision.tf32", "off", f"{device.type}: TF32 is a CUDA tensor-core mode")
    if requested == "on":
        return Decision("precision.tf32", "on", "asked for (precision.tf32=on)")
    if dtype != "fp32":
        return Decision("precision.tf32", "off", f"compute dtype is {dtype}: matmuls are not fp32")
    p = p or machine.probe(device)
    if "tf32" not in p.matmul_flops_per_s:
        why = p.matmul_notes.get("tf32", "not measured by this cached probe: slipstream doctor --refresh")
        return Decision("precision.tf32", "off", f"tf32: {why}")
    pays, line = dtype_verdict(p, "tf32")
    return Decision("precision.tf32", "on" if pays else "off", line)


def decide_serve_quantize(device: torch.device | str, p: MachineProbe | None = None) -> Decision:
    """serve --quantize auto: bf16 weights where bf16 pays, else fp32 (int8 changes answers more
    and is left to an explicit choice checked with `quantize-eval`)."""
    d = decide_precision(device, p)
    choice = "bf16" if d.choice == "bf16" else "none"
    return Decision("serve.quantize", choice, d.reason)


def describe(p: MachineProbe) -> list[str]:
    """Human lines: figures and the verdict per dtype (doctor and the demo print these)."""
    lines = [
        f"machine {p.fingerprint['cpu_model']} · {p.fingerprint['cpu_capability']} · "
        f"{p.fingerprint['threads']} threads · torch {p.fingerprint['torch']}"
        + (f" · {p.fingerprint['gpu']}" if "gpu" in p.fingerprint else ""),
    ]
    for dtype in ("fp32", "bf16", "fp16", *(("tf32",) if "tf32" in p.matmul_flops_per_s else ())):
        lines.append(dtype_verdict(p, dtype)[1])
    for kind, bps in p.copy_bytes_per_s.items():
        lines.append(f"copy {kind}: {bps / 1e9:.1f} GB/s")
    for name, c in p.checks.items():
        lines.append(f"{name}: {'ok' if c.ok else 'no'} ({c.detail})")
    busy = BUSY_LOAD_PER_THREAD * max(1, int(p.fingerprint.get("threads", 1)))
    if p.load_average_1m is not None and p.load_average_1m > busy:
        lines.append(
            f"note: measured while the 1-min load average was {p.load_average_1m:.1f}: other jobs "
            "may have skewed these figures; `slipstream doctor --refresh` on a quiet machine"
        )
    return lines


__all__ = [
    "PAYS_RATIO",
    "Decision",
    "bf16_pays",
    "decide_precision",
    "decide_serve_quantize",
    "decide_tf32",
    "describe",
    "dtype_verdict",
    "too_slow",
]
