"""`slipstream serve`: its flags, their checks (before the model loads), and building the app.

`add_parser(subparsers)` registers the command; `serve/cli.py` registers it with the others.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from ..commands import add_command, check_limits
from ..files import write_json

EXAMPLES = """examples:
  slipstream serve --model runs/a/export --port 8000      # a save_pretrained folder (HF causal LM)
  slipstream serve --model runs/a/export --compile-decode --generate-latency-budget-ms 10000
  slipstream serve --workload gpt-stdlib --checkpoint runs/a/checkpoint.pt --port 8000
  slipstream serve --size small --dtype bf16 --max-batch-size 32 --latency-budget-ms 200
  slipstream serve --size small --compile --workers 2 --threads 1   # the weights as saved (fp32 here)
  slipstream serve --size small --compile --quantize auto          # bf16 where the probe says it pays
  slipstream serve --size small --quantize bf16 --compile          # bf16 weights whatever the probe says
  slipstream serve --checkpoint runs/a --quantize int8-dynamic --generate-slots 8
  curl -s 127.0.0.1:8000/v1/score -d '{"text": "def f(x):\\n    return x\\n"}' -H 'content-type: application/json'
  curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "export", "prompt": "Copyright", "max_tokens": 32, "temperature": 0}'
"""


AUTO_EVAL_DOCS = 16
"""`--quantize auto` measures what its cast costs on this many validation documents at start-up."""
AUTO_EVAL_TOKENS = 256
"""... each cut to this many tokens (two forwards of 16 x 256 tokens: seconds on a CPU)."""


def resolve_quantize(quantize: str, dtype: str, device, probe=None, saved: str = "fp32"):
    """`--quantize` -> a mode, with its reason (a `decisions.Decision`).

    `none` (the default) serves the weights in the dtype they were saved in (`saved`), so served
    answers equal the model's own `generate`. `auto` casts fp32 weights to bf16 only where the
    machine probe measured bf16 matmuls faster than fp32 (they run ~75x slower on AVX2-only CPUs and
    ~0.55x on an Intel AVX512-BF16 one without AMX), else none; int8 is never picked by auto (it
    changes answers more: measure it with `quantize-eval`). Another explicit mode is kept."""
    from ..decisions import Decision, decide_serve_quantize

    if quantize == "none":
        return Decision("serve.quantize", "none", f"the weights as saved ({saved}); --quantize auto casts")
    if quantize != "auto":
        return Decision("serve.quantize", quantize, "set on the command line")
    if dtype == "bf16":
        return Decision("serve.quantize", "none", f"--dtype bf16 given: {saved} weights under bf16 autocast")
    if saved != "fp32":
        return Decision(
            "serve.quantize", "none", f"the weights were saved in {saved}: auto casts fp32 weights only"
        )
    return decide_serve_quantize(device, probe)


@dataclass(frozen=True)
class ServedWeights:
    """The dtype `serve` runs the weights in, the `--quantize` decision behind it, and (for a cast
    chosen by `auto`) what the cast measured at start-up."""

    decision: Any
    """decisions.Decision: the mode and why."""
    saved_dtype: str
    saved_dtype_source: str
    quality: Any = None
    """quantize.CastQuality, when `--quantize auto` cast the weights."""

    @property
    def dtype(self) -> str:
        mode = self.decision.choice
        if mode == "none":
            return self.saved_dtype
        return "bf16" if mode == "bf16" else f"{mode} (body linears; the rest {self.saved_dtype})"

    def to_dict(self) -> dict[str, Any]:
        out = {
            **self.decision.to_dict(),
            "served_dtype": self.dtype,
            "saved_dtype": self.saved_dtype,
            "saved_dtype_source": self.saved_dtype_source,
        }
        if self.quality is not None:
            out["quality"] = self.quality.to_dict()
        return out


def quantize_eval_command(args: argparse.Namespace, served: str) -> str:
    """The `slipstream quantize-eval` command that prices the cheaper modes against the served one."""
    if args.model:
        which = ["--model", args.model]
    else:
        which = ["--workload", args.workload] + (["--size", args.size] if args.size else [])
        which += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    modes = "none,bf16" if served in ("fp32", "fp16") else "none,int8-weight-only,int8-dynamic"
    return shlex.join(["slipstream", "quantize-eval", *which, "--modes", modes])


def apply_quantize(args: argparse.Namespace, loaded, device, probe=None) -> ServedWeights:
    """Decide `--quantize`, cast or quantise the weights in place, and say on stderr which dtype is
    served, why, and how to price the other choice (`auto`: what its cast measured)."""
    from .quantize import evaluation_docs, measure_cast, quantize_model

    decision = resolve_quantize(args.quantize, args.dtype, device, probe, saved=loaded.saved_dtype)
    quality = None
    if args.quantize == "auto" and decision.choice != "none":
        L = min(AUTO_EVAL_TOKENS, loaded.max_len)
        docs = [d[:L] for d in evaluation_docs(loaded, None, AUTO_EVAL_DOCS) if len(d) >= 2]
        quality = measure_cast(loaded, decision.choice, docs)
    else:
        quantize_model(loaded.model, decision.choice)
    served = ServedWeights(decision, loaded.saved_dtype, loaded.saved_dtype_source, quality)
    say = lambda line: print(f"slipstream serve: {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"serving weights in {served.dtype} (saved: {loaded.saved_dtype}, from {loaded.saved_dtype_source})")
    if args.quantize == "auto":
        say(f"--quantize auto -> {decision.choice}: {decision.reason}")
        if quality is not None:
            say(
                f"--quantize auto cast cost, {quality.describe()}; --quantize none serves the weights as "
                f"saved; measure on your own text: {quantize_eval_command(args, loaded.saved_dtype)} --data FILE"
            )
    elif decision.choice == "none":
        say(
            "cheaper weights change answers a little and may be faster here; price them first: "
            + quantize_eval_command(args, served.dtype)
        )
    return served


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse `serve` flags that cannot work, before the model loads (one line, exit 2)."""
    from ..recipe import RecipeError

    check_limits(
        positive={
            "--max-batch-size": args.max_batch_size,
            "--max-batch-tokens": args.max_batch_tokens,
            "--buckets": args.buckets,
            "--workers": args.workers,
            "--max-queue": args.max_queue,
            "--max-body-bytes": args.max_body_bytes,
            "--latency-budget-ms": args.latency_budget_ms,
            "--timeout-ms": args.timeout_ms,
            "--generate-latency-budget-ms": args.generate_latency_budget_ms,
        },
        at_least_0={
            "--threads": args.threads,
            "--generate-slots": args.generate_slots,
            "--drain-timeout": args.drain_timeout,
            "--generate-max-wait-ms": args.generate_max_wait_ms,
        },
    )
    if args.max_len is not None and args.max_len < 2:
        raise RecipeError(f"--max-len {args.max_len} must be at least 2")
    if not 0 <= args.port <= 65535:
        raise RecipeError(f"--port {args.port} must be between 0 and 65535 (0: any free port)")
    _check_port_free(args.host, args.port)


def _check_port_free(host: str, port: int) -> None:
    """Fail in a second, not after the model loaded and every shape warmed up."""
    import socket

    from ..recipe import RecipeError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise RecipeError(
            f"--host {host!r} does not resolve ({err.strerror}); use 127.0.0.1 or 0.0.0.0"
        ) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as err:
            raise RecipeError(
                f"--port {port} on {host} cannot be used ({err.strerror}); pick another --port "
                "or stop the server holding it"
            ) from None


def build_app_from_args(args: argparse.Namespace):
    """The FastAPI app, score engine, loaded model and the served weights (`ServedWeights`: the
    `--quantize` decision and the dtype) the `serve` flags describe."""
    check_serve_args(args)
    import torch

    from ..recipe import RecipeError
    from ..runtime import resolve_device
    from ..workloads.registry import get_workload
    from .app import create_app
    from .engine import EngineConfig, ScoreEngine
    from .model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.dtype == "bf16" and args.quantize not in ("none", "auto"):
        raise RecipeError("--dtype bf16 with --quantize: choose one (--quantize bf16 casts the weights)")
    if args.model:
        from .model import load_hf_model

        if args.checkpoint:
            raise RecipeError("--model and --checkpoint: give one (--model is a save_pretrained folder)")
        loaded = load_hf_model(args.model, device, max_len=args.max_len, name=args.served_model_name)
    else:
        loaded = load_model(args.workload, args.size, args.checkpoint, device, max_len=args.max_len or 1024)
        if args.served_model_name:
            from dataclasses import replace

            loaded = replace(loaded, name=args.served_model_name)
    served = apply_quantize(args, loaded, device)
    lengths = None
    if not args.model:
        try:
            lengths = get_workload(args.workload).load_data().validation_lengths
        except Exception as err:  # planning falls back to a single max_len bucket; say so
            print(f"slipstream serve: no length histogram ({err}); planning one row length", file=sys.stderr)
    cfg = EngineConfig(
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        n_lengths=args.buckets,
        max_queue=args.max_queue,
        latency_budget_s=args.latency_budget_ms / 1000,
        default_timeout_s=args.timeout_ms / 1000,
        dtype=args.dtype,
        workers=args.workers,
        static_shapes=args.static_shapes,
        compile=args.compile,
        batch_sizes=args.batch_sizes,
    )
    engine = ScoreEngine(loaded, cfg, expected_lengths=lengths)
    generator = None
    if args.generate_slots:
        from .generate import Generator, GeneratorConfig

        generator = Generator(
            loaded,
            GeneratorConfig(
                slots=args.generate_slots,
                policy=args.batching,
                dtype=args.dtype,
                compile=args.compile_decode,
                shed_wait_s=None if args.generate_max_wait_ms is None else args.generate_max_wait_ms / 1000,
                latency_budget_s=None
                if args.generate_latency_budget_ms is None
                else args.generate_latency_budget_ms / 1000,
            ),
            metrics=engine.metrics,
        )
    token = args.token or os.environ.get("SLIPSTREAM_SERVE_TOKEN") or None
    app = create_app(
        engine,
        generator,
        token=token,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        progress=lambda line: print(f"slipstream serve: {line}", file=sys.stderr, flush=True),
    )
    return app, engine, loaded, served


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import run_server

    app, engine, loaded, served = build_app_from_args(args)
    print(
        f"slipstream serve: {loaded.workload}/{loaded.size} '{loaded.name}' from {loaded.source}, "
        f"{len(engine.plan.shapes)} shapes, lengths {list(engine.plan.lengths)}; "
        f"warming up, then http://{args.host}:{args.port} (ready at /readyz)",
        file=sys.stderr,
        flush=True,
    )
    rc = run_server(app, args.host, args.port, args.drain_timeout)
    stats = engine.stats
    summary = {
        "requests": stats.requests,
        "batches": stats.batches,
        "mean_batch_size": stats.requests / stats.batches if stats.batches else None,
        "real_tokens": stats.real_tokens,
        "padded_tokens": stats.padded_tokens,
        "expired": stats.expired,
        "failed_batches": stats.failed_batches,
        "shapes_run": stats.shapes_run,
        "shape_latency_s": {f"{b}x{L}": t for (b, L), t in engine.plan.latency_s.items()},
        "quantize": served.to_dict(),
    }
    write_json(args.json, summary)
    print(f"slipstream serve: drained; {stats.requests} requests in {stats.batches} batches", file=sys.stderr)
    return rc


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags naming a built-in model (serve and quantize-eval share them)."""
    p.add_argument("--workload", default="gpt-stdlib", help="registered workload (default: gpt-stdlib)")
    p.add_argument("--size", default=None, help="model size (default: the checkpoint's, else small)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint.pt, its folder, or a .safetensors file (default: random init)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")


def add_parser(subparsers) -> None:
    p = add_command(
        subparsers,
        "serve",
        "serve a model over HTTP with dynamic batching into planned static shapes",
        EXAMPLES,
    )
    add_model_arguments(p)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (bf16 = autocast)"
    )
    p.add_argument(
        "--quantize",
        default="none",
        help="none (default: the weights in the dtype they were saved in: config.json's dtype, the "
        "checkpoint's tensors, fp32 when unset), auto (bf16 weights where the machine probe measured "
        "bf16 faster than fp32; logs what the cast measured), bf16, int8-weight-only, int8-dynamic (torchao)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal LM folder (save_pretrained: config, safetensors, tokenizer); "
        "nothing is downloaded. Default: the built-in GPT of --workload",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients name in OpenAI requests (default: the --model folder's name, or slipstream-gpt)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="longest sequence served: caps --model's context (smaller KV cache); positions of a "
        "random-init GPT (default 1024; a checkpoint sets its own)",
    )
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="padded tokens per forward at most")
    p.add_argument("--buckets", type=int, default=8, help="planned row lengths (the longest is max_len)")
    p.add_argument(
        "--workers", type=int, default=1, help="batches computed concurrently (CPU: pair with --threads)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the scoring forward with frozen weights (CUDA: a CUDA graph per shape); "
        "compiles during warm-up, before /readyz",
    )
    p.add_argument(
        "--static-shapes",
        choices=("auto", "on", "off"),
        default="auto",
        help="pad every batch to a planned shape (auto: on for CUDA or --compile, off for eager CPU)",
    )
    p.add_argument(
        "--batch-sizes",
        choices=("auto", "pow2", "all"),
        default="auto",
        help="planned batch sizes per length (auto: every size for static shapes on CPU, else powers of two)",
    )
    p.add_argument("--max-queue", type=int, default=512, help="waiting requests at most; more get 503")
    p.add_argument(
        "--latency-budget-ms", type=float, default=500.0, help="batch window and load-shedding target"
    )
    p.add_argument("--timeout-ms", type=float, default=10000.0, help="default request deadline (504 past it)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM"
    )
    p.add_argument(
        "--token", default=None, help="require 'Authorization: Bearer TOKEN' (or set SLIPSTREAM_SERVE_TOKEN)"
    )
    p.add_argument(
        "--generate-slots",
        type=int,
        default=8,
        help="KV-cache slots: sequences decoded together for the OpenAI endpoints and /v1/generate (0 = off)",
    )
    p.add_argument(
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help="generation batching policy",
    )
    p.add_argument(
        "--generate-max-wait-ms",
        type=float,
        default=None,
        help="refuse (503) a generation whose predicted wait for a slot exceeds this "
        "(default: only one predicted to miss its own deadline)",
    )
    p.add_argument(
        "--generate-latency-budget-ms",
        type=float,
        default=None,
        help="refuse (503) a generation whose predicted end-to-end latency (wait + its max_tokens "
        "decode steps, at the measured step time) exceeds this (default: no limit)",
    )
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="torch.compile the decode step (slow first start on CPU)",
    )
    p.add_argument("--json", default=None, help="write batching statistics here at exit")
    p.set_defaults(fn=cmd_serve)
