"""`slipstream quantize-eval`: validation-loss delta and latency of each serving quantization mode
against fp32 (the measuring is `serve/quantize.py`'s)."""

from __future__ import annotations

import argparse

from ..commands import add_command
from ..files import write_json
from .server_cli import add_model_arguments

EXAMPLES = """examples:
  slipstream quantize-eval --checkpoint runs/a/checkpoint.pt --json quant.json
  slipstream quantize-eval --size small --modes none,bf16,int8-weight-only,int8-dynamic --docs 100
  slipstream quantize-eval --checkpoint runs/a --modes none,bf16 --compile --threads 1
  slipstream quantize-eval --model runs/a/export --data notes.txt --modes none,bf16,int8-dynamic
"""


def cmd_quantize_eval(args: argparse.Namespace) -> int:
    from ..recipe import RecipeError
    from .quantize import QUANT_MODES, quantize_eval

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in QUANT_MODES]
    if bad:
        raise RecipeError(f"--modes: unknown {bad}; choose from {', '.join(QUANT_MODES)}")
    if not modes:
        raise RecipeError(f"--modes names no mode; choose from {', '.join(QUANT_MODES)}")
    if args.docs < 1 or args.reps < 1:
        raise RecipeError(f"--docs {args.docs} and --reps {args.reps} must both be at least 1")
    if args.max_len is not None and args.max_len < 2:
        raise RecipeError(f"--max-len {args.max_len} must be at least 2")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    res = quantize_eval(
        args.workload,
        args.size,
        args.checkpoint,
        modes,
        model_dir=args.model,
        data=args.data,
        n_docs=args.docs,
        reps=args.reps,
        max_len=args.max_len,
        compile=args.compile,
    )
    for row in res["results"]:
        lat = ", ".join(
            f"{k.removeprefix('latency_').removesuffix('_median_s')} {v * 1000:.1f} ms"
            for k, v in row.items()
            if k.startswith("latency_")
        )
        print(
            f"{row['mode']:>17}: val loss {row['validation_loss_nats']:.4f} (delta {row['loss_delta_vs_fp32_nats']:+.4f}), {lat}"
        )
    write_json(args.json, res)
    return 0


def add_parser(subparsers) -> None:
    p = add_command(
        subparsers,
        "quantize-eval",
        "validation-loss delta and latency of bf16 / int8 serving vs fp32",
        EXAMPLES,
    )
    add_model_arguments(p)
    p.add_argument("--model", default=None, help="a local Hugging Face causal LM folder (as serve --model)")
    p.add_argument(
        "--data",
        default=None,
        help="text to measure the loss on (.txt blank-line paragraphs, .jsonl, a folder); "
        "default: the gpt-stdlib validation split",
    )
    p.add_argument("--modes", default="none,bf16,int8-weight-only,int8-dynamic", help="comma-separated modes")
    p.add_argument("--docs", type=int, default=200, help="validation documents")
    p.add_argument("--reps", type=int, default=5, help="interleaved latency repetitions")
    p.add_argument(
        "--max-len", type=int, default=None, help="truncate documents / cap shapes (default: the model's)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="measure every mode compiled as `serve --compile` runs it (frozen weights)",
    )
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(fn=cmd_quantize_eval)
