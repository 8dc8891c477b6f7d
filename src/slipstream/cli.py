"""The `slipstream` command line: argument parsing and printing only; the work lives in the library."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .commands import (
    add_command,
    add_workload_arguments,
    progress_printer,
    run_command,
)
from .files import write_json
from .presets import resolve_recipe
from .recipe import RecipeError

EXAMPLES = {
    "train": """examples:
  slipstream train --workload gpt-stdlib --size tiny --recipe baseline --steps 50 --json out.json
  slipstream train --recipe baseline --set precision.dtype=bf16 --set shapes.max_len=512 --steps 200
  slipstream train --steps 400 --checkpoint-dir runs/a --checkpoint-every 50     # then add --resume
  slipstream train --model mymodels:build --data corpus.jsonl --tokenizer tok/ --export out/
""",
    "bench": """examples:
  slipstream bench --workload gpt-stdlib --size small --recipes baseline,bf16,bucket,pack,full \\
      --peers diy,accelerate,lightning --json out.json --report out.html
  slipstream bench --recipes demo --rounds 3              # the make demo list
  slipstream bench --recipes baseline,baseline+precision.dtype=bf16 --size tiny --rounds 5
""",
    "doctor": """examples:
  slipstream doctor
  slipstream doctor --json doctor.json --no-compile
  slipstream doctor --refresh          # measure again (say, the host was busy the first time)
""",
    "data": """examples:
  slipstream data --workload gpt-stdlib --max-len 1024
  slipstream data --max-len 512 --json corpus.json
  slipstream data --data notes.txt --tokenizer tok/     # your text, your tokenizer
""",
    "recipe": """examples:
  slipstream recipe baseline                  # print a preset as TOML
  slipstream recipe baseline+precision.dtype=bf16 --save my.toml
  slipstream recipe --fields                  # every field, its choices and what it does
""",
}


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .train import train

    if args.nproc < 1 or args.max_restarts < 0:
        raise RecipeError("--nproc must be >= 1 and --max-restarts >= 0")
    if args.nproc > 1 and "RANK" not in os.environ:
        return launch_ranks(args)

    recipe = resolve_recipe(args.recipe, args.set)
    result = train(
        args.workload,
        recipe,
        args.steps,
        size=args.size,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        progress=not args.no_progress,
        export_dir=args.export,
    )
    if result.extra.get("rank", 0) != 0:
        return 0  # one report per run: rank 0's
    payload = result.to_dict()
    write_json(args.json, payload)
    m = result.metrics
    table = Table(
        title=f"{result.workload} ({result.size}, {result.parameters:,} params) · recipe {recipe.name}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("steps", f"{result.steps}"),
        ("final train loss", f"{result.loss[-1]:.4f}"),
        *[
            (f"val loss @ step {v['step']}", f"{v['loss']:.4f}")
            for v in result.val_loss[:1] + result.val_loss[-1:]
        ],
        ("real tokens", f"{m.real_tokens:,}"),
        ("padded tokens", f"{m.padded_tokens:,}"),
        ("padding waste", f"{m.padding_waste:.3f}"),
        ("real tokens/s", f"{m.real_tokens_per_s:,.0f}"),
        ("step time (median)", f"{m.step_time_s * 1e3:.1f} ms"),
        ("first step", f"{m.first_step_s:.2f} s"),
        ("data wait (total)", f"{m.data_wait_s:.2f} s"),
        ("distinct shapes", f"{m.distinct_shapes}"),
        ("recompiles", f"{m.recompiles}"),
        ("peak memory", f"{m.peak_memory_bytes / 2**20:,.0f} MiB ({m.peak_memory_kind})"),
        ("device · precision", f"{m.device} · {m.precision}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    if args.export:
        print(f"exported the model to {args.export}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def launch_ranks(args: argparse.Namespace) -> int:
    """`train --nproc N`: the same command under torchrun, N ranks on this machine."""
    import subprocess

    argv = _strip_options(args.argv, {"--nproc", "--max-restarts"})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        f"--max-restarts={args.max_restarts}", "-m", "slipstream", *argv,
    ]  # fmt: skip
    env = dict(os.environ)
    # N ranks on one host share its cores: without this each would start one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    print(f"slipstream train: {args.nproc} ranks under torchrun", file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=env).returncode


def _strip_options(argv: list[str], names: set[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a.split("=", 1)[0] not in names:
            out.append(a)
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    from .bench.report import print_summary, print_table, write_html
    from .presets import demo_recipes

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    _check_bench_args(args, recipes)
    demo = recipes == ["demo"]
    if demo:
        recipes = demo_recipes()
    # The demo shows what pays here: a recipe forcing a cheaper dtype runs only where the probe
    # measured it faster than fp32 by PAYS_RATIO; elsewhere only dtypes 4x+ slower are skipped.
    from .bench.runner import SLOW_DTYPE_FACTOR
    from .decisions import PAYS_RATIO

    min_dtype_speed = None if args.all_dtypes else PAYS_RATIO if demo else 1 / SLOW_DTYPE_FACTOR
    if args.set:  # the same overrides for every recipe (and so for the peers, via the reference)
        recipes = [r + "".join(f"+{a}" for a in args.set) for r in recipes]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else []
    if demo or args.show_machine:
        from .decisions import describe
        from .machine import probe
        from .runtime import resolve_device

        device = resolve_device(resolve_recipe(recipes[0]).runtime.device)
        for line in describe(probe(device)):
            print(line, file=sys.stderr, flush=True)
    with progress_printer("bench") as say:
        result = run_bench(
            args.workload,
            recipes,
            size=args.size,
            rounds=args.rounds,
            round_tokens=args.round_tokens,
            warmup_steps=args.warmup_steps,
            val_batches=args.val_batches,
            peers=peers,
            memory="skip" if args.no_memory else "auto",
            parity_floor=args.parity_floor,
            noise_seeds=args.noise_seeds,
            numerics_seeds=args.numerics_seeds,
            precision_seeds=args.precision_seeds,
            paired=not args.unpaired,
            parity_steps=args.parity_steps,
            match_steps=not args.no_match_steps,
            min_dtype_speed=min_dtype_speed,
            max_round_s=args.max_round_s,
            twins=not args.no_twins,
            progress=say,
        )
    payload = result.to_dict()
    write_json(args.json, payload)
    print_table(payload)
    print_summary(payload)
    if args.report:
        path = write_html(payload, Path(args.report))
        print(f"report: {path} (and {path.with_suffix('.md')})")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _check_bench_args(args: argparse.Namespace, recipes: list[str]) -> None:
    """Refuse bench flags that would run anyway and report nonsense (before any contender runs)."""
    if not recipes:
        raise RecipeError("--recipes names no recipe; give one or more, e.g. --recipes baseline,bf16")
    bad = [
        msg
        for ok, msg in (
            (args.warmup_steps >= 0, f"--warmup-steps {args.warmup_steps} must be >= 0"),
            (args.val_batches >= 1, f"--val-batches {args.val_batches} must be >= 1"),
            (args.parity_floor >= 0, f"--parity-floor {args.parity_floor} must be >= 0"),
            (
                args.parity_steps is None or args.parity_steps >= 0,
                f"--parity-steps {args.parity_steps} must be >= 0 (0: time --rounds only)",
            ),
            (
                args.precision_seeds is None or args.precision_seeds >= 0,
                f"--precision-seeds {args.precision_seeds} must be >= 0 (0: judge on the numerics band)",
            ),
            (
                args.round_tokens is None or args.round_tokens >= 1,
                f"--round-tokens {args.round_tokens} must be >= 1",
            ),
            (
                args.max_round_s is None or args.max_round_s > 0,
                f"--max-round-s {args.max_round_s} must be > 0",
            ),
        )
        if not ok
    ]
    if bad:
        raise RecipeError("; ".join(bad))


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose

    report = diagnose(check_compile=not args.no_compile, refresh=args.refresh)
    write_json(args.json, report)
    print(f"python {report['python']} · torch {report['torch']} · {report['platform']}")
    for line in report["summary"]:
        print(f"  {line}")
    for name, d in report["decisions"].items():
        print(f"auto {name} -> {d['choice']}: {d['reason']}")
    if report["probe_source"] == "cache":
        source = (
            f"read from cache in {report['lookup_s']:.2f} s (measured {report['probe_measured_at']} "
            f"in {report['probe_s']:.1f} s; --refresh measures again)"
        )
    else:
        source = f"measured now in {report['probe_s']:.1f} s"
    print(f"probe {source} · {report['probe_cache_file']}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from .recipe import ShapesConfig
    from .shapes import SHAPE_POLICIES, ShapedLoader
    from .workloads import get_workload
    from .workloads.corpus import LengthStats

    if args.max_len < 2:
        raise RecipeError(f"--max-len {args.max_len} must be at least 2")
    if args.tokens_per_batch < 1:
        raise RecipeError(f"--tokens-per-batch {args.tokens_per_batch} must be at least 1")
    wl = get_workload(args.workload)
    data = wl.load_data()
    out: dict[str, Any] = {"workload": wl.name, "max_len": args.max_len, "splits": {}, "padding_waste": {}}
    for split, lengths in (("train", data.train_lengths), ("validation", data.validation_lengths)):
        out["splits"][split] = LengthStats.of(lengths).__dict__
    print(f"{wl.name}: {wl.description}")
    for split, s in out["splits"].items():
        print(
            f"  {split:10} {s['documents']:6d} docs  {s['total_tokens']:>10,d} tokens  "
            f"median {s['median']:.0f}  p90 {s['p90']:.0f}  p99 {s['p99']:.0f}  max {s['max']}"
        )
    print(
        f"padding waste over one training epoch at max_len {args.max_len} (tokens_per_batch {args.tokens_per_batch}):"
    )
    for mode in sorted(SHAPE_POLICIES):
        cfg = ShapesConfig(mode=mode, max_len=args.max_len, tokens_per_batch=args.tokens_per_batch)
        loader = ShapedLoader(data.train, cfg, lengths=data.train_lengths, pad_id=data.pad_id)
        waste = loader.padding_waste()
        shapes = len({p.shape for p in loader.plans()})
        out["padding_waste"][mode] = waste
        out.setdefault("distinct_shapes", {})[mode] = shapes
        print(f"  {mode:10} {waste:.3f}  ({len(loader)} batches, {shapes} distinct shapes)")
    write_json(args.json, out)
    return 0


def cmd_recipe(args: argparse.Namespace) -> int:
    from .presets import PRESETS
    from .recipe import describe_fields, save_recipe

    if args.fields and args.markdown:
        print("| field | choices / type | default | what it does |\n|---|---|---|---|")
        for path, tp, default, doc in describe_fields():
            choices = tp.replace("|", "\\|")
            print(f"| `{path}` | {choices} | `{default!r}` | {doc} |")
        return 0
    if args.fields:
        for path, tp, default, doc in describe_fields():
            print(f"{path:28} {tp:40} default {default!r}\n    {doc}")
        return 0
    if not args.spec:
        for name, fn in sorted(PRESETS.items()):
            print(f"{name:12} {(fn.__doc__ or '').strip()}")
        return 0
    args.recipe = args.spec
    recipe = resolve_recipe(args.recipe, args.set)
    if args.save:
        print(f"wrote {save_recipe(recipe, args.save)}")
    else:
        import tomli_w

        print(tomli_w.dumps(recipe.to_dict()), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Make PyTorch training faster through software alone, and measure every gain.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run `slipstream COMMAND --help` for each command's options and examples",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return add_command(sub, name, help_, EXAMPLES[name])

    p = add("train", "train a built-in workload, or your own model and data, under a recipe")
    add_workload_arguments(p)
    p.add_argument(
        "--recipe", default="baseline", help="preset, .toml/.json file, or preset+section.field=value"
    )
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one recipe field")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument(
        "--eval-every", type=int, default=50, help="validation every N steps, 0 = never (default: 50)"
    )
    p.add_argument(
        "--eval-batches", type=int, default=4, help="validation batches per evaluation (default: 4)"
    )
    p.add_argument("--checkpoint-dir", help="folder for checkpoint.pt (written atomically)")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="checkpoint every N steps (and at the end)"
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's checkpoint")
    p.add_argument("--json", help="write results (per-step loss, metrics) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--export",
        metavar="DIR",
        help="after training, write the model (+ tokenizer) here (docs/own-model.md)",
    )
    g = p.add_argument_group("several processes (docs/distributed.md)")
    g.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks on this machine: runs torchrun underneath (recipe distributed.strategy: ddp, fsdp)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: torchrun restarts all ranks this often after a failure; they resume "
        "from --checkpoint-dir's last checkpoint",
    )
    p.set_defaults(fn=cmd_train)

    p = add("bench", "benchmark recipes and peers side by side (interleaved rounds) with a report")
    add_workload_arguments(p)
    p.add_argument(
        "--recipes", default="baseline", help="comma-separated specs, or `demo`; the first is the reference"
    )
    p.add_argument(
        "--peers",
        default="",
        help="comma-separated: diy, accelerate, lightning, hf-trainer, hf-trainer-flat (the last two for Hugging Face models)",
    )
    p.add_argument(
        "--set", action="append", metavar="SECTION.FIELD=VALUE", help="override a field in every recipe"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument(
        "--round-tokens", type=int, help="real tokens per contender per round (default: 2 batches' budget)"
    )
    p.add_argument(
        "--warmup-steps", type=int, default=2, help="untimed steps per contender first (default: 2)"
    )
    p.add_argument("--val-batches", type=int, default=4, help="validation batches for the loss/parity check")
    p.add_argument(
        "--noise-seeds",
        type=int,
        help="null re-runs of the reference (paired: another document order inside each window, same "
        "init; --unpaired: other seeds); their spread is the order band (default: 2 where some verdict "
        "rests on it — a peer, a custom contender or a recipe without twin on other batches — else 0)",
    )
    p.add_argument(
        "--numerics-seeds",
        type=int,
        help="re-runs of the reference on its own batches with the rows permuted (another reduction "
        "order): the numerics band, which judges a recipe on those batches in the reference's "
        "precision (default: 1 where one is judged, else 0; more narrow a band the re-run widened)",
    )
    p.add_argument(
        "--precision-seeds",
        type=int,
        help="re-runs of the reference in each other precision a recipe on its batches computes in "
        "(bf16, fp16), with the rows permuted: that recipe's parity band (default: 2 where needed; "
        "0 judges it on the reference's own numerics band, docs/bench.md)",
    )
    p.add_argument(
        "--unpaired",
        action="store_true",
        help="the seed-band design: contenders keep their own init and data order (no pairing)",
    )
    p.add_argument(
        "--parity-floor",
        type=float,
        default=0.002,
        help="smallest relative val-loss gap ever allowed, when the seeds land closer (default: 0.002)",
    )
    p.add_argument(
        "--parity-steps",
        type=int,
        help="train the reference at least this many optimizer steps, adding rounds, before judging "
        "parity (default: 100, where planted faults show in the loss); 0: only --rounds, and a pass "
        "on fewer than 100 steps is unjudged",
    )
    p.add_argument(
        "--no-twins",
        action="store_true",
        help="no numerics twin for a recipe that changes batching and numerics together (auto, "
        "bucket+bf16): its parity then rests on the order band alone, so the 2 order re-runs are "
        "trained in place of its twin and of the precision or numerics re-runs no other recipe needs "
        "(docs/bench.md)",
    )
    p.add_argument(
        "--no-match-steps",
        action="store_true",
        help="keep each recipe's own tokens per batch instead of the reference's real tokens per step",
    )
    p.add_argument(
        "--all-dtypes",
        action="store_true",
        help="run bf16/fp16 contenders even where the probe measured them 4x+ slower than fp32",
    )
    p.add_argument(
        "--max-round-s", type=float, help="cut a contender's round after this many seconds (parity unjudged)"
    )
    p.add_argument("--show-machine", action="store_true", help="print the machine probe first (demo does)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-recipe peak-memory runs on CPU")
    p.add_argument("--json", help="write the result (schema: docs/bench.md)")
    p.add_argument("--report", help="write an HTML report here (and a .md beside it)")
    p.set_defaults(fn=cmd_bench)

    p = add(
        "doctor",
        "measure what this machine does fast (matmul FLOP/s per dtype, copy bandwidth, compile, "
        "Triton; cached) and print what every auto decides from it",
    )
    p.add_argument("--json", help="write the report, with the full probe, to this file")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile check (15-25 s on first use) unless it is cached",
    )
    p.add_argument("--refresh", action="store_true", help="measure again instead of reading the cached probe")
    p.set_defaults(fn=cmd_doctor)

    p = add("data", "length histogram of a workload's corpus and the padding waste of each shape policy")
    add_workload_arguments(p)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--json", help="write the statistics to this file")
    p.set_defaults(fn=cmd_data)

    p = add("recipe", "list presets, show or save a recipe, or list every recipe field")
    p.add_argument("spec", nargs="?", help="preset, file, or preset+section.field=value")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override one recipe field")
    p.add_argument("--save", help="write the recipe to this .toml or .json file")
    p.add_argument("--fields", action="store_true", help="list every field with its type and docstring")
    p.add_argument(
        "--markdown", action="store_true", help="with --fields: print a Markdown table (docs/recipe.md)"
    )
    p.set_defaults(fn=cmd_recipe)

    # Components with commands of their own register them (their heavy imports stay lazy).
    from .optimize.cli import add_parser as add_optimize
    from .profile.cli import add_parser as add_profile
    from .serve.cli import add_parser as add_serve
    from .tune.cli import add_parser as add_tune

    add_profile(sub)
    add_tune(sub)
    add_serve(sub)
    add_optimize(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
