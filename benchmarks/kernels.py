"""Kernel benchmarks. CPU: the memory figures. GPU: time, GB/s and memory of every op.

    python benchmarks/kernels.py memory   # CPU acceptance: fused linear CE vs F.cross_entropy(x @ W.T, y)
    python benchmarks/kernels.py speed    # GPU: eager torch vs torch.compile vs Triton, fwd / bwd / full

Memory is measured per variant in a fresh subprocess as the peak-RSS delta (VmHWM after the step minus
VmRSS before it, with the high-water mark reset through /proc/self/clear_refs after the inputs exist),
repeated A B A B ... Speed is timed interleaved (A B C A B C ..., warm-up excluded); each row reports the
median and p20/p80. Results go to benchmarks/results/kernels-<device>-<date>.json (write temp, rename).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"


# ---- shared ---------------------------------------------------------------------------------


def machine() -> dict:
    from slipstream.doctor import machine_info

    info = machine_info()
    if torch.cuda.is_available():
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["device"] = "cpu"  # the result file name uses cpu-<host>
    return info


def write_result(payload: dict, device_label: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device_label.lower()).strip("-")
    path = RESULTS / f"kernels-{slug}-{payload['machine']['date']}.json"
    from slipstream.files import write_json

    write_json(path, payload)  # atomic: never a half-written results file
    return path


def summary(values: list[float]) -> dict:
    s = sorted(values)
    q = statistics.quantiles(s, n=5, method="inclusive") if len(s) >= 2 else [s[0]] * 4
    return {"median": statistics.median(s), "p20": q[0], "p80": q[3], "n": len(s)}


# ---- CPU memory (acceptance) ----------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(variant: str, tokens: int, hidden: int, vocab: int, out: str | None) -> None:
    """One variant, one step, in this fresh process; prints a JSON line."""
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_(True)
    y = torch.randint(0, vocab, (tokens,))
    if variant == "fused":
        from slipstream.kernels import fused_linear_cross_entropy

        def step():
            return fused_linear_cross_entropy(x, w, y, backend="torch")
    else:

        def step():
            return F.cross_entropy(x @ w.t(), y)

    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    t0 = time.perf_counter()
    loss = step()
    gx, gw = torch.autograd.grad(loss, (x, w))
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    if out:
        torch.save({"loss": loss.detach(), "gx": gx, "gw": gw}, out)
    print(json.dumps({"variant": variant, "peak_rss_delta_bytes": (peak - before) * 1024, "step_s": seconds}))


def run_memory(args) -> dict:
    shape = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab}
    runs = {"reference": [], "fused": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for variant in ("reference", "fused"):  # A B A B: drift on a noisy machine hits both
                out = os.path.join(tmp, f"{variant}.pt") if rep == 0 else ""
                cmd = [sys.executable, __file__, "_memory_child", variant, *map(str, shape.values()), out]
                line = (
                    subprocess.run(cmd, check=True, capture_output=True, text=True)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                runs[variant].append(json.loads(line))
                print(f"  rep {rep} {variant:9s} {runs[variant][-1]}", flush=True)
        ref = torch.load(os.path.join(tmp, "reference.pt"))
        fused = torch.load(os.path.join(tmp, "fused.pt"))
    match = {}
    for key in ("loss", "gx", "gw"):
        a, b = fused[key].double(), ref[key].double()
        scale = b.abs().max().item()
        match[key] = {
            "max_abs_err": (a - b).abs().max().item(),
            "max_abs_ref": scale,
            "max_err_rel_to_max": (a - b).abs().max().item() / scale,
            # elementwise rtol 1e-5, with an atol of 1e-5 of the largest element for near-zero entries
            "allclose_rtol_1e-5": bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale)),
        }
    peaks = {v: summary([r["peak_rss_delta_bytes"] for r in rs]) for v, rs in runs.items()}
    times = {v: summary([r["step_s"] for r in rs]) for v, rs in runs.items()}
    ratio = peaks["fused"]["median"] / peaks["reference"]["median"]
    return {
        "what": "CPU fp32 linear+cross-entropy, loss + grads of x and W, peak RSS delta per fresh process",
        "shape": shape,
        "peak_rss_delta_bytes": peaks,
        "step_s": times,
        "fused_over_reference_peak": ratio,
        "acceptance_peak_ratio_max": 0.25,
        "acceptance_peak_ok": ratio <= 0.25,
        "match": match,
        "acceptance_match_ok": all(m["allclose_rtol_1e-5"] for m in match.values()),
    }


# ---- GPU speed ------------------------------------------------------------------------------


def _timer(device):
    if device.type == "cuda":

        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3

    else:

        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

    return timed


def copy_bandwidth(device, nbytes: int) -> float:
    """Device-to-device copy GB/s (read + write counted), the roof for memory-bound kernels."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    timed = _timer(device)
    for _ in range(3):
        dst.copy_(src)
    return 2 * nbytes / 1e9 / statistics.median(timed(lambda: dst.copy_(src)) for _ in range(20))


def op_cases(device, small: bool, dtype):
    """(name, inputs factory, {variant: fn}, bytes moved fwd, bytes moved bwd) for each op."""
    from slipstream import kernels as K
    from slipstream.kernels import reference as R

    s = torch.tensor([], dtype=dtype).element_size()
    n, d, v, f = (64, 48, 300, 96) if small else (16384, 4096, 128256, 11008)
    n_ce = 64 if small else 8192

    def rand(*shape, scale=1.0):
        return lambda: (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(True)

    def labels(rows, vocab):
        return torch.randint(0, vocab, (rows,), device=device)

    y_ce, y_lce = labels(n_ce, v), labels(n_ce, v)
    cases = [
        ("cross_entropy", [rand(n_ce, v)], {
            "eager": lambda x: R.cross_entropy(x, y_ce),
            "triton": lambda x: K.cross_entropy(x, y_ce, backend="triton")}, 2 * n_ce * v * s, 2 * n_ce * v * s),
        ("rms_norm", [rand(n, d), rand(d)], {
            "eager": R.rms_norm, "triton": lambda x, w: K.rms_norm(x, w, backend="triton")}, 2 * n * d * s, 3 * n * d * s),
        ("layer_norm", [rand(n, d), rand(d), rand(d)], {
            "eager": R.layer_norm,
            "triton": lambda x, w, b: K.layer_norm(x, w, b, backend="triton")}, 2 * n * d * s, 3 * n * d * s),
        ("add_rms_norm", [rand(n, d), rand(n, d), rand(d)], {
            "eager": R.add_rms_norm,
            "triton": lambda x, r, w: K.add_rms_norm(x, r, w, backend="triton")}, 4 * n * d * s, 4 * n * d * s),
        ("swiglu", [rand(n, f), rand(n, f)], {
            "eager": R.swiglu, "triton": lambda g, u: K.swiglu(g, u, backend="triton")}, 3 * n * f * s, 5 * n * f * s),
        ("gelu_tanh", [rand(n, f)], {
            "eager": R.gelu_tanh, "triton": lambda x: K.gelu_tanh(x, backend="triton")}, 2 * n * f * s, 3 * n * f * s),
        ("fused_linear_cross_entropy", [rand(n_ce, d), rand(v, d, scale=0.02)], {
            "eager": lambda x, w: R.linear_cross_entropy(x, w, y_lce),
            "triton": lambda x, w: K.fused_linear_cross_entropy(x, w, y_lce, backend="triton")}, None, None),
    ]  # fmt: skip
    for _, _, variants, _, _ in cases:
        variants["compile"] = torch.compile(variants["eager"], dynamic=False)
    return cases


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def run_speed(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    timed = _timer(device)
    roof = copy_bandwidth(device, (1 << 20) if args.small else (1 << 30))
    rows = []
    for name, factories, variants, fwd_bytes, bwd_bytes in op_cases(device, args.small, dtype):
        inputs = [make() for make in factories]
        samples = {(var, ph): [] for var in variants for ph in ("fwd", "bwd", "full")}
        peaks = {}
        for rep in range(args.warmup + args.reps):
            for var, fn in variants.items():  # interleaved: A B C A B C ...
                ups = [torch.randn_like(o) for o in _outputs(fn(*inputs))]

                def backward(outs, ups=ups):
                    torch.autograd.backward(list(outs), ups)

                t_fwd = timed(lambda fn=fn, inputs=inputs: fn(*inputs))
                outs = _outputs(fn(*inputs))
                t_bwd = timed(lambda outs=outs, backward=backward: backward(outs))
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t_full = timed(lambda fn=fn, b=backward, inputs=inputs: b(_outputs(fn(*inputs))))
                if device.type == "cuda":
                    peaks[var] = torch.cuda.max_memory_allocated() - base
                for t in inputs:
                    t.grad = None
                if rep >= args.warmup:
                    for ph, t in (("fwd", t_fwd), ("bwd", t_bwd), ("full", t_full)):
                        samples[(var, ph)].append(t)
        for var in variants:
            row = {"op": name, "variant": var, "dtype": str(dtype).replace("torch.", "")}
            row["shapes"] = [list(t.shape) for t in inputs]
            for ph in ("fwd", "bwd", "full"):
                st = summary(samples[(var, ph)])
                row[f"{ph}_ms"] = {k: (v * 1e3 if k != "n" else v) for k, v in st.items()}
            if fwd_bytes:
                row["fwd_GBps"] = fwd_bytes / 1e9 / row["fwd_ms"]["median"] * 1e3
                row["bwd_GBps"] = bwd_bytes / 1e9 / row["bwd_ms"]["median"] * 1e3
                row["fwd_frac_of_copy_bw"] = row["fwd_GBps"] / roof
                row["bwd_frac_of_copy_bw"] = row["bwd_GBps"] / roof
            if var in peaks:
                row["peak_memory_bytes"] = peaks[var]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"copy_bandwidth_GBps": roof, "rows": rows}


# ---- CLI ------------------------------------------------------------------------------------


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_memory_child":
        variant, tokens, hidden, vocab, out = argv[1:6]
        memory_child(variant, int(tokens), int(hidden), int(vocab), out or None)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("memory", help="CPU peak memory of fused linear CE vs the unfused reference")
    m.add_argument("--tokens", type=int, default=8192)
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--vocab", type=int, default=32768)
    m.add_argument("--reps", type=int, default=3)
    m.add_argument("--no-write", action="store_true", help="print only, write no results file")
    s = sub.add_parser("speed", help="GPU: eager vs torch.compile vs Triton per op")
    s.add_argument("--device", default=None, help="default: cuda when available")
    s.add_argument("--small", action="store_true", help="tiny shapes: checks the script, not the hardware")
    s.add_argument("--reps", type=int, default=20)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    result = run_memory(args) if args.cmd == "memory" else run_speed(args)
    info = machine()
    payload = {"benchmark": f"kernels.{args.cmd}", "machine": info, "result": result}
    if args.cmd == "memory":  # speed rows were printed as they came
        print(json.dumps(result, indent=2))
    if not args.no_write:
        label = info["device"] if info["device"] != "cpu" else f"cpu-{info['host']}"
        print("wrote", write_result(payload, f"{args.cmd}-{label}"))


if __name__ == "__main__":
    main()
