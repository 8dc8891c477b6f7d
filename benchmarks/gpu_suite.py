"""Every GPU path of slipstream in one run (issue 16): sized to finish in <= 8 minutes on one H200.

    python benchmarks/gpu_suite.py                 # on a CUDA machine: writes benchmarks/results/gpu-suite-<gpu>-<date>.json
    python benchmarks/gpu_suite.py --cpu-smoke     # each section's code path on CPU with tiny sizes (CI: cannot rot)
    python benchmarks/gpu_suite.py --only probe,kernels --out /tmp/x.json

Sections, in order (each isolated: one that fails is recorded with its error and the rest go on):

- probe       the machine probe re-measured: matmul FLOP/s per dtype at 1024..8192^2 (the MFU peak),
              host<->device copy bandwidth pinned and pageable, device-to-device copy bandwidth, Triton check
- kernels     every Triton kernel against eager torch and torch.compile (forward, forward+backward),
              GB/s against the measured device copy bandwidth
- cudagraphs  one CUDA graph per bucket shape (CUDAGraphModel) against eager training steps: the
              launch overhead saved per step
- prefetch    side-stream prefetch (dataflow.Prefetcher): the share of the host-to-device copy time
              hidden behind compute
- precision   fp32, bf16, fp16 with dynamic loss scaling, fp8 (torchao) training through Session
- mfu         GPT-2-124M training tokens/s and MFU against the bf16 peak the probe measured: eager
              at 16k/64k/128k tokens per step, compile default/max-autotune and `auto` at 64k
- kernel_choice  kernels.ops=auto's per-op decision (ours, Liger-Kernel, inductor, the model's own)
              at GPT-2-124M and Llama-88M widths, eager and under a whole-model compile
- llama       a user's Llama-88M from a config: auto's batch search, bench with that GPU-sized
              reference against hf-trainer, hf-trainer-flat, accelerate, and optimize --budget 3m
- serve       the scoring engine eager and compiled (inductor CUDA graphs per planned shape, replays
              on one thread), throughput, latency and the scores of both compared
- tests       the `gpu`-marked tests, through pytest

The result is one JSON file (device, driver, torch, CUDA, Triton, date; per section its status, the
seconds it took and its figures). With --cpu-smoke the same functions run on CPU with tiny sizes;
a section or variant that needs CUDA (CUDA graph capture, fp8, inductor's CUDA graphs, the gpu tests
themselves) says so as `skipped` with the reason. Smoke figures check the plumbing, not the hardware.
Exit status 1 when any section failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repo root first: run as a script, Python puts benchmarks/ there, where kernels.py would shadow
# any top-level `kernels` module a library imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SCHEMA = "slipstream.gpu_suite/1"
BUDGET_S = 450.0
"""Seconds the sections may take together on a GPU (the 8-minute promise less start-up and slack):
a section whose estimate no longer fits is skipped, saying so."""


class Skip(Exception):
    """A section (or the rest of one) that cannot run here; the message is the reason."""


@dataclass
class Context:
    device: Any  # torch.device
    smoke: bool
    deadline: float
    results: dict[str, dict] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def say(self, msg: str) -> None:
        print(f"[gpu-suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- timing


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn: Callable[[], Any]) -> float:
    """Seconds `fn` took, the device's queued work included (CUDA events on a GPU)."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(device, fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(timed(device, fn) for _ in range(reps))


# ----------------------------------------------------------------------------- sections


def section_probe(ctx: Context) -> dict:
    """Matmul peak per dtype and copy bandwidth: the machine probe (re-measured, cache rewritten) on a
    GPU; in smoke, the probe's own measuring functions at tiny sizes (the cache is left alone)."""
    import torch

    from slipstream import machine

    out: dict[str, Any] = {}
    if ctx.smoke:
        flops, notes = machine.measure_matmul(ctx.device, ("fp32", "bf16"), (32, 64))
        copy_bps = machine.measure_copy(ctx.device, nbytes=1 << 20, repeats=2)
        triton = machine.check_triton(ctx.device)
    else:
        p = machine.probe(ctx.device, refresh=True, checks=("triton",))
        flops, notes, copy_bps, triton = (
            p.matmul_flops_per_s,
            p.matmul_notes,
            p.copy_bytes_per_s,
            p.checks["triton"],
        )
        out["probe_s"] = p.probe_s
        out["sizes"] = list(machine.matmul_sizes(ctx.device))
    out["matmul_tflops"] = {d: {n: f / 1e12 for n, f in t.items()} for d, t in flops.items()}
    out["peak_tflops"] = {d: max(t.values()) / 1e12 for d, t in flops.items() if t}
    out["matmul_notes"] = notes
    out["copy_GBps"] = {k: v / 1e9 for k, v in copy_bps.items()}
    out["device_copy_GBps"] = _device_copy_GBps(ctx, (1 << 30) if ctx.cuda else (1 << 20))
    out["triton"] = {"ok": triton.ok, "detail": triton.detail}
    if ctx.cuda:
        out["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return out


def _device_copy_GBps(ctx: Context, nbytes: int) -> float:
    """Device-to-device copy, read + write counted: the roof for memory-bound kernels."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    t = median_time(ctx.device, lambda: dst.copy_(src), reps=10 if ctx.cuda else 3, warmup=2)
    return 2 * nbytes / t / 1e9


def section_kernels(ctx: Context) -> dict:
    """Triton kernels vs eager torch vs torch.compile, the cases of benchmarks/kernels.py speed."""
    import torch

    from slipstream.kernels.dispatch import triton_available

    kb = importlib.import_module("benchmarks.kernels")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32  # Triton's interpreter has no bf16
    roof = ctx.results.get("probe", {}).get("device_copy_GBps") or _device_copy_GBps(ctx, 1 << 20)
    cases = kb.op_cases(ctx.device, ctx.smoke, dtype)
    notes = {}
    if ctx.smoke:
        # A CPU inductor compile costs 15-25 s per graph on 2 cores: dynamo's plumbing only.
        notes["compile"] = "backend=eager in --cpu-smoke (dynamo tracing only, no inductor code generation)"
        for _, _, variants, _, _ in cases:
            variants["compile"] = torch.compile(variants["eager"], backend="eager", dynamic=False)
    if not triton_available():
        notes["triton"] = "triton is not installed: pip install 'slipstream[kernels]'"
        for _, _, variants, _, _ in cases:
            variants.pop("triton")
    elif not ctx.cuda:
        notes["triton"] = "Triton's CPU interpreter (TRITON_INTERPRET=1): numerics path only"
    reps, warmup = (2, 1) if ctx.smoke else (10, 2)
    rows = []
    for name, factories, variants, fwd_bytes, bwd_bytes in cases:
        if ctx.left() < (5 if ctx.smoke else 25):
            notes[name] = f"not run: time budget ({ctx.left():.0f} s left)"
            continue
        ctx.say(f"kernels: {name}")
        inputs = [make() for make in factories]
        for var, fn in variants.items():
            row: dict[str, Any] = {"op": name, "variant": var, "dtype": str(dtype).replace("torch.", "")}
            try:
                ups = [torch.randn_like(o) for o in kb._outputs(fn(*inputs))]

                def full(fn=fn, ups=ups, inputs=inputs):
                    torch.autograd.backward(list(kb._outputs(fn(*inputs))), ups)

                t_fwd = median_time(ctx.device, lambda fn=fn, inputs=inputs: fn(*inputs), reps, warmup)
                if ctx.cuda:
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                    base = torch.cuda.memory_allocated(ctx.device)
                t_full = median_time(ctx.device, full, reps, warmup)
                if ctx.cuda:
                    row["full_peak_extra_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - base
                for t in inputs:
                    t.grad = None
            except Exception as err:  # a kernel that fails is a finding, not the end of the section
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                rows.append(row)
                continue
            row["fwd_ms"], row["full_ms"] = t_fwd * 1e3, t_full * 1e3
            if fwd_bytes:
                row["fwd_GBps"] = fwd_bytes / t_fwd / 1e9
                row["full_GBps"] = (fwd_bytes + bwd_bytes) / t_full / 1e9
                row["fwd_frac_of_copy_bw"] = row["fwd_GBps"] / roof
                row["full_frac_of_copy_bw"] = row["full_GBps"] / roof
            rows.append(row)
    for name in {r["op"] for r in rows}:  # speed-up of each variant over eager, per op
        eager = next((r for r in rows if r["op"] == name and r["variant"] == "eager" and "fwd_ms" in r), None)
        for r in rows:
            if eager and r["op"] == name and "full_ms" in r:
                r["full_speedup_vs_eager"] = eager["full_ms"] / r["full_ms"]
    failed = [f"{r['op']}/{r['variant']}" for r in rows if "error" in r]
    return {"device_copy_GBps": roof, "notes": notes, "rows": rows, "failed": failed}


def _stub_capture(fn, sample_args):
    """CPU stand-in for make_graphed_callables: 'replays' run eagerly (the dispatch is what runs)."""
    return fn


def section_cudagraphs(ctx: Context) -> dict:
    """Training steps of a small GPT per bucket shape: eager against one CUDA graph per shape."""
    import torch

    from slipstream.compile import CUDAGraphModel
    from slipstream.workloads.gpt import build_gpt

    if ctx.smoke:
        size, buckets, steps = "tiny", [(4, 16), (2, 32)], 3
    else:
        size, buckets, steps = "small", [(64, 128), (32, 256), (16, 512), (8, 1024)], 20
    torch.manual_seed(0)
    eager = build_gpt(size, max_len=max(t for _, t in buckets)).to(ctx.device)
    graphed = CUDAGraphModel(
        copy.deepcopy(eager), max_shapes=len(buckets), capture=None if ctx.cuda else _stub_capture
    )
    fused = {"fused": True} if ctx.cuda else {}
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4, **fused) for m in (eager, graphed)}
    vocab = eager.config.vocab_size

    def step(model, batch):
        loss = model(**batch)
        loss.backward()
        opts[id(model)].step()
        opts[id(model)].zero_grad(set_to_none=True)
        return loss

    rows = []
    for B, T in buckets:
        g = torch.Generator(device="cpu").manual_seed(B * T)
        batch = {
            k: torch.randint(0, vocab, (B, T), generator=g).to(ctx.device) for k in ("input_ids", "labels")
        }
        losses = {}
        for name, model in (("eager", eager), ("graphed", graphed)):
            for _ in range(2):  # warm-up; the graphed model captures this shape on its first step
                losses[name] = step(model, batch).detach()
        gap = float((losses["eager"] - losses["graphed"]).abs())
        t = {}
        for name, model in (("eager", eager), ("graphed", graphed)):
            t[name] = (
                timed(ctx.device, lambda model=model, batch=batch: [step(model, batch) for _ in range(steps)])
                / steps
            )
        rows.append(
            {
                "shape": [B, T],
                "eager_ms": t["eager"] * 1e3,
                "graphed_ms": t["graphed"] * 1e3,
                "launch_overhead_saved_ms": (t["eager"] - t["graphed"]) * 1e3,
                "saved_frac": 1 - t["graphed"] / t["eager"],
                "loss_gap_after_warmup": gap,
            }
        )
    out = {"model": size, "steps_timed": steps, "rows": rows, "stats": graphed.stats()}
    if not ctx.cuda:
        out["note"] = "CPU smoke: stub capture (no CUDA graph exists on CPU); the per-shape dispatch ran"
    return out


def section_prefetch(ctx: Context) -> dict:
    """Share of the host-to-device copy time the side-stream prefetcher hides behind compute."""
    import torch

    from slipstream.dataflow import Prefetcher

    n, numel = (3, 1 << 14) if ctx.smoke else (12, 1 << 24)  # GPU: 128 MiB of int64 per batch
    # Pinned beforehand (a loader's worker pool pins them), so what is measured is the side stream's
    # overlap, not the producer thread's pinning copy.
    host = [torch.randint(0, 1000, (numel,)) for _ in range(n)]
    host = [b.pin_memory() for b in host] if ctx.cuda else host
    copy_s = timed(ctx.device, lambda: [b.to(ctx.device) for b in host])
    # compute per batch about as long as its copy, so all of the copy could be hidden
    a = torch.randn(2048 if ctx.cuda else 64, 2048 if ctx.cuda else 64, device=ctx.device)
    a = a.to(torch.bfloat16) if ctx.cuda else a
    per_mm = median_time(ctx.device, lambda: a @ a, reps=5, warmup=2)
    k = max(1, math.ceil(copy_s / n / per_mm))

    def work(x):
        for _ in range(k):
            a @ a
        return x[:1].sum()

    resident = [b.to(ctx.device) for b in host]
    compute_s = timed(ctx.device, lambda resident=resident: [work(x) for x in resident])
    del resident
    serial_s = timed(ctx.device, lambda: [work(b.to(ctx.device)) for b in host])

    def prefetched():
        with Prefetcher(iter(host), depth=2, device=ctx.device, pin_memory=True) as p:
            for x in p:
                work(x)

    prefetched()  # warm-up: the side stream, pinned buffers
    pre_s = timed(ctx.device, prefetched)
    hidden = (serial_s - pre_s) / copy_s if copy_s > 0 else 0.0
    out = {
        "batches": n,
        "batch_bytes": numel * 8,
        "copy_s": copy_s,
        "compute_s": compute_s,
        "serial_s": serial_s,
        "prefetched_s": pre_s,
        "copy_hidden_share": max(0.0, min(1.0, hidden)),
        "copy_hidden_share_raw": hidden,
    }
    if not ctx.cuda:
        out["note"] = "CPU smoke: no host-to-device copy exists on CPU; the prefetch thread path ran"
    return out


def _gpt_data():
    from slipstream.workloads import get_workload

    return get_workload("gpt-stdlib").load_data()


def _contender(spec: str, size: str, data, reference: str):
    from slipstream.bench.runner import RecipeContender
    from slipstream.presets import resolve_recipe

    return RecipeContender(spec, "gpt-stdlib", size, data, 2, resolve_recipe(reference))


def section_precision(ctx: Context) -> dict:
    """A few training steps per dtype through Session: speed, loss, fp16 loss scaling, fp8 layers."""
    from slipstream.recipe import RecipeError

    size, max_len, tokens, steps = ("tiny", 64, 512, 3) if ctx.smoke else ("small", 512, 16384, 30)
    dev = "cuda" if ctx.cuda else "cpu"
    common = f"+shapes.max_len={max_len}+shapes.tokens_per_batch={tokens}+runtime.device={dev}"
    data = _gpt_data()
    rows: dict[str, dict] = {}
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        spec = f"baseline+precision.dtype={dtype}" + common
        ctx.say(f"precision: {dtype}")
        try:
            c = _contender(spec, size, data, "baseline" + common)
        except RecipeError as err:  # this device cannot run it: the message names why and the fix
            rows[dtype] = {"status": "skipped", "reason": str(err)}
            continue
        try:
            c.run_round(None, max_steps=2)  # warm-up
            st = c.run_round(None, max_steps=steps)
            m = c.session.metrics()
            rows[dtype] = {
                "status": "ok",
                "real_tokens_per_s": st.real_tokens / st.seconds,
                "step_ms": st.seconds / st.steps * 1e3,
                "first_loss": st.losses[0],
                "last_loss": st.losses[-1],
                "val_loss": c.validation_loss(),
                "skipped_steps": m.skipped_steps,
                **{k: m.extra[k] for k in ("loss_scale", "fp8_linears") if k in m.extra},
            }
        except Exception as err:
            rows[dtype] = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:300]}
        finally:
            c.close()
    return {"model": size, "steps": steps, "rows": rows}


def _gpt_flops_per_token(model, seq_len: int) -> tuple[float, float]:
    """(6N, 6N + attention): training FLOPs per token (PaLM appendix B: 12 L d T for attention)."""
    n = sum(p.numel() for p in model.parameters())
    cfg = model.config
    return 6.0 * n, 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def section_mfu(ctx: Context) -> dict:
    """GPT-2-124M training throughput and MFU against the bf16 matmul peak the probe measured."""
    peaks = ctx.results.get("probe", {}).get("peak_tflops") or {}
    if ctx.smoke:
        size, max_len, steps, dtype, device = "tiny", 64, 3, "fp32", "cpu"
        sizes, big = (256, 512, 1024), 512
        common = f"+shapes.max_len={max_len}+runtime.device={device}"
        dtype_set = ""
    else:
        size, max_len, steps, dtype, device = "gpt2-124m", 1024, 20, "bf16", "cuda"
        sizes, big = (16384, 65536, 131072), 65536
        common = f"+shapes.max_len={max_len}+runtime.device={device}"
        dtype_set = "+precision.dtype=bf16"
    # eager at three batch sizes (where the GPU stops being launch-bound), then at >= 64k tokens per
    # step the best fixed recipe and `auto` (issue 23's goal: >= 55% MFU, auto >= 1.3x eager bf16)
    specs = [f"baseline{dtype_set}+shapes.tokens_per_batch={n}{common}" for n in sizes]
    specs += [
        f"baseline{dtype_set}+compile.mode=default+shapes.tokens_per_batch={big}{common}",
        f"baseline{dtype_set}+compile.mode=max-autotune+shapes.tokens_per_batch={big}{common}",
        f"auto+shapes.tokens_per_batch={big}{common}",
    ]
    if ctx.smoke:
        specs = [sp for sp in specs if "max-autotune" not in sp and "compile.mode=default" not in sp]
    peak = peaks.get(dtype)
    if not peak:
        raise Skip(f"no {dtype} matmul peak from the probe section (run it first)")
    data = _gpt_data()
    rows = []
    for spec in specs:
        ctx.say(f"mfu: {spec}")
        row: dict[str, Any] = {"recipe": spec}
        c = None
        try:
            c = _contender(spec, size, data, specs[0])
            t0 = time.perf_counter()
            c.run_round(None, max_steps=3)  # compile and warm-up
            row["warmup_s"] = time.perf_counter() - t0
            st = c.run_round(None, max_steps=steps)
            positions = st.real_tokens + st.padded_tokens
            f6n, fattn = _gpt_flops_per_token(c.model, max_len)
            row.update(
                params=sum(p.numel() for p in c.model.parameters()),
                step_ms=st.seconds / st.steps * 1e3,
                positions_per_s=positions / st.seconds,
                real_tokens_per_s=st.real_tokens / st.seconds,
                mfu_6n=positions / st.seconds * f6n / (peak * 1e12),
                mfu_with_attention=positions / st.seconds * fattn / (peak * 1e12),
                last_loss=st.losses[-1],
                decisions=dict(getattr(getattr(c, "session", None), "decisions", {}) or {}),
            )
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        finally:
            if c is not None:
                c.close()
        rows.append(row)
    eager = next((r for r in rows if r["recipe"] == specs[sizes.index(big)] and "step_ms" in r), None)
    for r in rows:
        if eager and "step_ms" in r:
            r["speed_vs_eager_at_same_tokens"] = (
                eager["positions_per_s"] and r["positions_per_s"] / eager["positions_per_s"]
            )
    return {
        "model": size,
        "peak_tflops": peak,
        "peak_dtype": dtype,
        "flops_per_token": "6N over every computed position (padding included); +12 L d T with attention",
        "rows": rows,
    }


def section_kernel_choice(ctx: Context) -> dict:
    """The per-op decision kernels.ops=auto makes at GPT-2-124M and Llama-88M widths: ours, Liger's,
    inductor's and the model's own module, forward + backward, and which one it keeps."""
    import torch

    from slipstream.kernels.chooser import OpWidths, choose_op

    if ctx.smoke:
        models = {"gpt2-tiny": OpWidths(256, 64, 259, 256, 64), "llama-tiny": OpWidths(256, 64, 512, 172, 64)}
        dtype = torch.float32
    else:
        models = {
            "gpt2-124m": OpWidths(16384, 768, 50304, 3072, 768),
            "llama-88m": OpWidths(16384, 768, 8192, 2048, 768),
        }
        dtype = torch.bfloat16
    ops = {
        "gpt2": ("layer_norm", "gelu_tanh", "cross_entropy", "linear_cross_entropy"),
        "llama": ("rms_norm", "swiglu", "linear_cross_entropy"),
    }
    rows = []
    for model, widths in models.items():
        for op in ops[model.split("-")[0]]:
            for compiled in (False, True) if ctx.cuda else (False,):  # a CPU compile per op: minutes
                ctx.say(f"kernel_choice: {model} {op} compiled={compiled}")
                verdict = choose_op(op, widths, ctx.device, dtype, compiled_model=compiled)
                keep = verdict.seconds.get("keep")
                rows.append(
                    {
                        "model": model,
                        "op": op,
                        "whole_model_compiled": compiled,
                        "choice": verdict.choice,
                        "ms": {c: t * 1e3 for c, t in verdict.seconds.items()},
                        "speed_vs_keep": {c: keep / t for c, t in verdict.seconds.items() if keep},
                        "not_timed": verdict.not_timed,
                        "shape": verdict.shape,
                    }
                )
                if ctx.cuda:
                    torch.cuda.empty_cache()
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}


def _hf_data(folder: Path, smoke: bool) -> tuple[Path, Path]:
    """The Debian-copyright corpus and a locally trained 8k BPE (benchmarks/hf_corpus.py)."""
    from benchmarks.hf_corpus import train_tokenizer

    from slipstream.workloads.corpus import copyright_paragraphs

    texts = copyright_paragraphs()
    if smoke:
        texts = texts[:300]
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, folder / "tok")
    return corpus, folder / "tok"


def _slipstream_cli(ctx: Context, args: list[str], timeout_s: float) -> dict:
    """One slipstream command in a child process (as a user runs it), its --json result back."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-suite-{os.getpid()}-{args[0]}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "slipstream", *args, "--json", str(out)]
    ctx.say("run: " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    return json.loads(out.read_text())


def section_llama(ctx: Context) -> dict:
    """A user's model: a Llama of ~88M from a config on local text. The batch size auto picks on
    this device, then `bench` with that GPU-sized reference against hf-trainer, hf-trainer-flat and
    accelerate, then `optimize --budget 3m` (issue 23: auto >= 30% MFU, >= 3x the fastest peer)."""
    import tempfile

    import torch

    from slipstream import Session
    from slipstream.workloads.user import UserSpec, UserWorkload

    folder = Path(tempfile.mkdtemp(prefix="gpu-suite-llama-"))
    corpus, tok = _hf_data(folder, ctx.smoke)
    model_ref = "benchmarks.hf_models:" + ("llama_small" if ctx.smoke else "llama_mid")
    device = "cpu" if ctx.smoke else "cuda"
    out: dict[str, Any] = {"model": model_ref, "data": "Debian copyright paragraphs, 8k BPE trained here"}

    # 1. the batch search on its own: what `auto` sizes a step to here
    user = UserWorkload(UserSpec(model_ref, str(corpus), str(tok)))
    data = user.load_data()
    spec = "auto+shapes.max_len=512" + (
        "+shapes.mode=bucket+runtime.device=cpu" if ctx.smoke else "+runtime.device=cuda"
    )
    session = Session(spec)
    session.prepare_model(user.build_model("custom", 512))
    session.prepare_loader(data.train, pad_id=data.pad_id, lengths=data.train_lengths)
    chosen = session.decisions.get("shapes.tokens_per_batch")
    out["batch_search"] = chosen or {"choice": "8192", "reason": f"{device}: not searched"}
    tokens = int(out["batch_search"]["choice"]) if not ctx.smoke else 1024
    session.close()
    del session
    if ctx.cuda:
        torch.cuda.empty_cache()

    # 2. bench with that reference: every contender held to its real tokens per optimizer step;
    # 3. optimize on the same model and reference
    common = ["--model", model_ref, "--data", str(corpus), "--tokenizer", str(tok)]
    sets = ["--set", "shapes.max_len=512", "--set", f"shapes.tokens_per_batch={tokens}"]
    bench_args = ["--recipes", "baseline,auto", "--peers", "hf-trainer,hf-trainer-flat,accelerate",
                  "--rounds", "3", "--round-tokens", str(8 * tokens), "--max-round-s", "20", "--no-memory"]  # fmt: skip
    base = f"baseline+shapes.max_len=512+shapes.tokens_per_batch={tokens}"
    commands = {
        "bench": ["bench", *common, *sets, *bench_args],
        "optimize": ["optimize", *common, "--base", base, "--budget", "3m"],
    }
    out["commands"] = {k: "slipstream " + " ".join(v) for k, v in commands.items()}
    if ctx.smoke:  # bench and optimize on HF models are covered by tests/bench and tests/optimize
        out["bench"] = out["optimize"] = {"status": "skipped", "reason": "smoke: needs minutes on a CPU"}
        return out
    bench = _slipstream_cli(ctx, commands["bench"], 900)
    out["bench"] = {
        "method": {k: bench.get("method", {}).get(k) for k in ("real_tokens_per_step", "parity_noise_band")},
        "contenders": [
            {k: c.get(k) for k in ("name", "real_tokens_per_s", "mfu", "val_loss", "parity", "parity_gap")}
            for c in bench.get("contenders", [])
        ],
    }
    opt = _slipstream_cli(ctx, commands["optimize"], 600)
    out["optimize"] = {k: opt.get(k) for k in ("recipe", "speedup", "stages", "candidates", "parity_band")}
    return out


def section_serve(ctx: Context) -> dict:
    """The scoring engine eager and, on CUDA, compiled with a CUDA graph per planned shape."""
    import numpy as np

    from slipstream.serve.engine import EngineConfig, ScoreEngine
    from slipstream.serve.model import load_model

    size, max_len, n = ("tiny", 64, 16) if ctx.smoke else ("small", 512, 256)
    loaded = load_model(size=size, max_len=max_len, device=ctx.device)
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, max_len + 1, n)
    requests = [rng.integers(1, 256, int(L)).tolist() for L in lengths]
    variants = [("eager", False), ("compiled", True)]
    out: dict[str, Any] = {"model": size, "requests": n}
    scores: dict[str, list[float]] = {}
    for name, compiled in variants:
        if compiled and not ctx.cuda:
            out[name] = {
                "status": "skipped",
                "reason": "needs CUDA: inductor's CUDA graphs per planned shape (a CPU compile costs 15-25 s per graph)",
            }
            continue
        ctx.say(f"serve: {name}")
        cfg = EngineConfig(
            compile=compiled, workers=2, max_batch_size=8, n_lengths=3, warmup_reps=3, latency_budget_s=60.0,
            default_timeout_s=120.0, dtype="bf16" if ctx.cuda else "fp32",
        )  # fmt: skip
        eng = ScoreEngine(loaded, cfg, expected_lengths=lengths)
        latencies: list[float] = []

        async def one(tokens, eng=eng, latencies=latencies):
            t0 = time.perf_counter()
            r = await eng.score(tokens)
            latencies.append(time.perf_counter() - t0)
            return r

        async def run(eng=eng, one=one):
            t0 = time.perf_counter()
            await eng.start()
            warm = time.perf_counter() - t0
            t1 = time.perf_counter()
            results = await asyncio.gather(*[one(r) for r in requests])
            wall = time.perf_counter() - t1
            await eng.drain(30)
            return warm, wall, results

        warm, wall, results = asyncio.run(run())
        scores[name] = [r["logprob_sum"] for r in results]
        out[name] = {
            "status": "ok",
            "warmup_s": warm,
            "requests_per_s": n / wall,
            "scored_tokens_per_s": sum(r["scored_tokens"] for r in results) / wall,
            "latency_p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "latency_p99_ms": float(np.percentile(latencies, 99) * 1e3),
            "batches": eng.stats.batches,
            "shapes": len(eng.plan.shapes),
            "warmup_latency_ms": {f"{b}x{L}": t * 1e3 for (b, L), t in eng.plan.latency_s.items()},
            "replays_on_one_thread": eng._graph_thread is not None,
        }
    if len(scores) == 2:
        gaps = [abs(a - b) / max(1.0, abs(a)) for a, b in zip(scores["eager"], scores["compiled"])]
        out["compiled_vs_eager_max_rel_gap"] = max(gaps)
    return out


def _gpu_test_files() -> list[str]:
    files = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if "pytest.mark.gpu" in path.read_text(errors="replace"):
            files.append(str(path.relative_to(REPO)))
    return files


def section_tests(ctx: Context) -> dict:
    """The `gpu`-marked tests through pytest (in smoke: collected only, since each one needs CUDA)."""
    files = _gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    if ctx.smoke:
        cmd.append("--collect-only")
    timeout = max(30.0, min(300.0, ctx.left())) if not ctx.smoke else 120.0
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next(
        (line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error|skipped)|collected", line)),
        "",
    )
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", summary)
    if collected:
        counts["collected"] = int(collected.group(1))
    out: dict[str, Any] = {
        "files": files,
        "returncode": proc.returncode,
        "summary": summary,
        "counts": counts,
    }
    if ctx.smoke:
        if proc.returncode != 0:
            raise RuntimeError(f"collecting the gpu tests failed: {' | '.join(tail[-5:])}")
        out["status"] = "skipped"
        if not counts.get("collected"):
            raise RuntimeError(f"no gpu-marked test collected from {files}: {summary!r}")
        out["reason"] = f"needs CUDA: {counts['collected']} gpu-marked tests collected, none run"
        return out
    if proc.returncode != 0:
        out["failures_tail"] = tail[-40:]
    return out


SECTIONS: dict[str, tuple[Callable[[Context], dict], float]] = {
    # name: (function, seconds it needs on an H200, a generous estimate; the budget check uses it)
    "probe": (section_probe, 20),
    "kernels": (section_kernels, 150),
    "cudagraphs": (section_cudagraphs, 20),
    "prefetch": (section_prefetch, 15),
    "precision": (section_precision, 40),
    "mfu": (section_mfu, 150),
    "kernel_choice": (section_kernel_choice, 60),
    "llama": (section_llama, 330),
    "serve": (section_serve, 70),
    "tests": (section_tests, 60),
}


# ----------------------------------------------------------------------------- the run


def machine_block(device) -> dict:
    import torch

    info: dict[str, Any] = {
        "device": "cpu",
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except Exception:
        info["torchao"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = props.name
        info["capability"] = f"{props.major}.{props.minor}"
        info["memory_bytes"] = props.total_memory
        info["sms"] = props.multi_processor_count
        info["driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch

        v = torch._C._cuda_getDriverVersion()  # the CUDA version the driver supports, e.g. 12040
        return f"cuda-driver-api {v // 1000}.{v % 1000 // 10}"
    except Exception:
        return None


def run(smoke: bool, only: list[str] | None, budget_s: float) -> dict:
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    import torch

    if smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("gpu_suite: no CUDA device visible; run with --cpu-smoke to check the script on CPU")
    t_start = time.perf_counter()
    ctx = Context(device, smoke, t_start + budget_s)
    names = only or list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"gpu_suite: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    for name in names:
        fn, need_s = SECTIONS[name]
        t0 = time.perf_counter()
        ctx.say(f"section {name}")
        entry: dict[str, Any]
        if not smoke and ctx.left() < need_s:
            entry = {
                "status": "skipped",
                "reason": f"time budget: {ctx.left():.0f} s left, needs ~{need_s:.0f} s",
            }
        else:
            try:
                figures = fn(ctx)
                entry = {"status": figures.pop("status", "ok"), **figures}
            except Skip as why:
                entry = {"status": "skipped", "reason": str(why)}
            except Exception as err:
                entry = {
                    "status": "failed",
                    "error": f"{type(err).__name__}: {err}"[:500],
                    "traceback_tail": traceback.format_exc().strip().splitlines()[-8:],
                }
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        entry["seconds"] = time.perf_counter() - t0
        ctx.results[name] = entry
        ctx.say(f"section {name}: {entry['status']} in {entry['seconds']:.1f} s")
    return {
        "schema": SCHEMA,
        "mode": "cpu-smoke" if smoke else "gpu",
        "machine": machine_block(device),
        "budget_s": budget_s,
        "wall_s": time.perf_counter() - t_start,
        "sections": ctx.results,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def output_path(out: str | None, result: dict) -> Path:
    name = f"gpu-suite-{_slug(result['machine']['device'])}-{result['machine']['date'][:10]}.json"
    if out is None:
        return RESULTS / name
    path = Path(out)
    return path if path.suffix == ".json" else path / name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="every section's code path on CPU, tiny sizes")
    p.add_argument("--out", help="result file (.json) or folder (default benchmarks/results/)")
    p.add_argument("--only", help=f"comma-separated sections, in order; default all: {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds the sections may take on a GPU")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    result = run(args.cpu_smoke, only, args.budget_s)
    path = output_path(args.out, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    from slipstream.files import write_json

    write_json(path, json.loads(json.dumps(result, default=str)))  # atomic: never half a file
    status = {k: v["status"] for k, v in result["sections"].items()}
    print(json.dumps({"out": str(path), "wall_s": round(result["wall_s"], 1), "sections": status}))
    return 1 if "failed" in status.values() else 0


if __name__ == "__main__":
    sys.exit(main())
