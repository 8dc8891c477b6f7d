"""Acceptance figures for slipstream.precision (issue 4): bf16 vs fp32 speed and loss parity.

    python benchmarks/precision.py --throughput            # real tokens/s fp32 vs bf16, interleaved
    python benchmarks/precision.py --parity --steps 200    # loss curves fp32 / bf16 / fp32 other seed
    python benchmarks/precision.py --all --out benchmarks/results/precision-cpu-2core-2026-12-02.json
    python benchmarks/precision.py --parity --set shapes.max_len=256 --set shapes.tokens_per_batch=2048
    python benchmarks/precision.py --memory                # peak RSS: activation checkpointing off/on

Speed is a ratio measured side by side in one process: chunks of steps A B A B ..., the first
round is warm-up and excluded, the median over rounds is reported with its spread (min..max).
Memory runs each case as a fresh `slipstream train` subprocess (peak RSS is a process high-water
mark) and reports peak_memory_bytes. Parity compares per-step training losses with slipstream.precision.parity; the noise floor is the
gap between two fp32 runs that differ only in seed, which is what the default tolerance must exceed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def machine() -> dict[str, object]:
    from slipstream.doctor import machine_info

    return machine_info()


def _recipe(dtype: str, overrides: list[str], seed: int = 0):
    from slipstream.presets import resolve_recipe

    return resolve_recipe(
        "+".join(["baseline", f"precision.dtype={dtype}", f"runtime.seed={seed}", *overrides])
    )


def throughput(size: str, overrides: list[str], rounds: int, steps_per_round: int) -> dict[str, object]:
    """fp32 and bf16 trained side by side on the same batches; real tokens/s per round."""
    from slipstream.session import Session
    from slipstream.workloads import get_workload

    wl = get_workload("gpt-stdlib")
    data = wl.load_data()
    runs = {}
    for dtype in ("fp32", "bf16"):
        recipe = _recipe(dtype, overrides)
        session = Session(recipe)
        model = session.prepare_model(wl.model(size, recipe.shapes.max_len))
        opt = session.build_optimizer(model)
        loader = session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
        runs[dtype] = (session, model, opt, loader.forever())
    per_round: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds + 1):
        for dtype, (session, model, opt, batches) in runs.items():
            tokens, t0 = 0, time.perf_counter()
            for _ in range(steps_per_round):
                batch = next(batches)
                with session.autocast():
                    loss = model(**batch)
                session.backward(loss)
                session.step(opt)
                tokens += batch.real_tokens
            loss.item()  # the last step's work is done before the clock stops
            if r > 0:  # round 0 is warm-up
                per_round[dtype].append(tokens / (time.perf_counter() - t0))
    ratios = [b / f for f, b in zip(per_round["fp32"], per_round["bf16"])]
    out: dict[str, object] = {
        "size": size,
        "overrides": overrides,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "ratio_bf16_over_fp32_median": float(np.median(ratios)),
        "ratio_min": float(min(ratios)),
        "ratio_max": float(max(ratios)),
    }
    for k, v in per_round.items():
        out[f"{k}_real_tokens_per_s_median"] = float(np.median(v))
        out[f"{k}_real_tokens_per_s_rounds"] = v
    return out


def parity_runs(size: str, overrides: list[str], steps: int) -> dict[str, object]:
    from slipstream.precision import DEFAULT_PARITY_TOLERANCE, parity
    from slipstream.train import train

    curves: dict[str, list[float]] = {}
    times: dict[str, float] = {}
    for name, dtype, seed in (("fp32", "fp32", 0), ("bf16", "bf16", 0), ("fp32_seed1", "fp32", 1)):
        t0 = time.perf_counter()
        res = train(
            "gpt-stdlib",
            _recipe(dtype, overrides, seed),
            steps=steps,
            size=size,
            eval_every=0,
            progress=False,
        )
        times[name] = time.perf_counter() - t0
        curves[name] = res.loss
        print(f"  {name}: final loss {np.mean(res.loss[-20:]):.4f} ({times[name]:.0f} s)", flush=True)
    bf16 = parity(curves["bf16"], curves["fp32"])
    noise = parity(curves["fp32_seed1"], curves["fp32"])
    return {
        "size": size,
        "overrides": overrides,
        "steps": steps,
        "default_tolerance": DEFAULT_PARITY_TOLERANCE,
        "bf16_vs_fp32": bf16.to_dict(),
        "fp32_seed1_vs_fp32_noise_floor": noise.to_dict(),
        "wall_s": times,
        "loss_curves": curves,
    }


def memory(size: str, overrides: list[str], steps: int = 3) -> dict[str, object]:
    """Peak process RSS of a short training run per case, each in its own process."""
    cases = {
        "fp32": ["precision.dtype=fp32"],
        "fp32_ac": ["precision.dtype=fp32", "compile.activation_checkpointing=blocks"],
        "bf16": ["precision.dtype=bf16"],
        "bf16_ac": ["precision.dtype=bf16", "compile.activation_checkpointing=blocks"],
    }
    out: dict[str, object] = {"size": size, "overrides": overrides, "steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in cases.items():
            path = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "slipstream.cli", "train", "--size", size, "--recipe", "baseline"]
            cmd += [a for x in [*overrides, *sets] for a in ("--set", x)]
            cmd += ["--steps", str(steps), "--eval-every", "0", "--no-progress", "--json", str(path)]
            subprocess.run(cmd, check=True, capture_output=True)
            res = json.loads(path.read_text())
            out[f"{name}_peak_memory_bytes"] = res["peak_memory_bytes"]
            out[f"{name}_step_time_s"] = res["step_time_s"]
            print(
                f"  {name}: peak RSS {res['peak_memory_bytes'] / 2**20:.0f} MiB, step {res['step_time_s']:.2f} s"
            )
    for dt in ("fp32", "bf16"):
        saved = out[f"{dt}_peak_memory_bytes"] - out[f"{dt}_ac_peak_memory_bytes"]  # type: ignore[operator]
        out[f"{dt}_ac_saved_bytes"] = saved
        out[f"{dt}_ac_step_time_ratio"] = out[f"{dt}_ac_step_time_s"] / out[f"{dt}_step_time_s"]  # type: ignore[operator]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--size", default="small")
    ap.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="recipe override"
    )
    ap.add_argument("--parity-set", action="append", default=None, help="overrides for --parity only")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, object] = {"benchmark": "precision", "machine": machine()}
    if args.throughput or args.all:
        tp = throughput(args.size, args.set, args.rounds, args.steps_per_round)
        result["throughput"] = tp
        print(
            f"bf16 / fp32 real tokens/s on gpt-stdlib {args.size}: {tp['ratio_bf16_over_fp32_median']:.2f}x "
            f"(min {tp['ratio_min']:.2f}, max {tp['ratio_max']:.2f}; fp32 "
            f"{tp['fp32_real_tokens_per_s_median']:.0f}, bf16 {tp['bf16_real_tokens_per_s_median']:.0f} tok/s)",
            flush=True,
        )
    if args.parity or args.all:
        pr = parity_runs(args.size, args.parity_set if args.parity_set is not None else args.set, args.steps)
        result["parity"] = pr
        b, n = pr["bf16_vs_fp32"], pr["fp32_seed1_vs_fp32_noise_floor"]
        print(
            f"bf16 vs fp32 after {args.steps} steps: {b['parity_reason']} -> {'PASS' if b['parity_passed'] else 'FAIL'}"
        )
        print(f"noise floor (fp32 seed 1 vs seed 0): gap {n['parity_gap']:.2%}")
    if args.memory:
        mem = memory(args.size, args.set)
        result["memory"] = mem
        for dt in ("fp32", "bf16"):
            print(
                f"activation checkpointing, {dt}: peak RSS {mem[f'{dt}_peak_memory_bytes'] / 2**20:.0f} -> "
                f"{mem[f'{dt}_ac_peak_memory_bytes'] / 2**20:.0f} MiB, step time x{mem[f'{dt}_ac_step_time_ratio']:.2f}"
            )
    if args.out:
        from slipstream.files import write_json

        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
