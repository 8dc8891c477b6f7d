"""Acceptance figures for slipstream.shapes on the built-in corpus (issue 3).

    python benchmarks/shapes.py --waste                 # padding waste of every policy (seconds)
    python benchmarks/shapes.py --parity                # per-document loss packed vs unpacked, fp32
    python benchmarks/shapes.py --recompiles            # compile on, 200 steps: shapes and recompiles
    python benchmarks/shapes.py --throughput            # fp32 eager `small`: real tokens/s, interleaved
    python benchmarks/shapes.py --all --out benchmarks/results/shapes-cpu-2core-2026-12-02.json

Speed is a ratio measured side by side in one process: rounds A B C A B C ..., the first round is
warm-up and excluded, and the median over rounds is reported with its spread (min..max).
Each --recompiles run is a fresh subprocess, so dynamo's caches and counters start empty.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch

MAX_LEN = 1024


def machine() -> dict[str, object]:
    from slipstream.doctor import machine_info

    return machine_info()


def corpus():
    from slipstream.workloads import get_workload

    return get_workload("gpt-stdlib").load_data()


def waste() -> dict[str, object]:
    from slipstream.recipe import ShapesConfig
    from slipstream.shapes import ShapedLoader

    data = corpus()
    out: dict[str, object] = {}
    cases = [
        ("pad_max", {}),
        ("pad_batch", {}),
        ("bucket", {"buckets": 8}),
        ("bucket", {"buckets": 10}),
        ("bucket", {"buckets": "auto"}),
        ("pack", {"pack_algorithm": "bfd"}),
        ("pack", {"pack_algorithm": "greedy"}),
    ]
    for overflow in ("truncate", "split"):
        for mode, extra in cases:
            cfg = ShapesConfig(mode=mode, max_len=MAX_LEN, overflow=overflow, **extra)
            t0 = time.perf_counter()
            loader = ShapedLoader(data.train, cfg, lengths=data.train_lengths, pad_id=data.pad_id)
            plan_s = time.perf_counter() - t0
            shapes = {p.shape for p in loader.plans()}
            key = f"{overflow}/{mode}" + "".join(f"/{k}={v}" for k, v in extra.items())
            out[key] = {
                "padding_waste": round(loader.padding_waste(), 4),
                "batches": len(loader),
                "distinct_shapes": len(shapes),
                "plan_s": round(plan_s, 3),
                **{k: v for k, v in loader.policy.describe().items() if not isinstance(v, float)},
            }
            print(
                f"  {key:45} waste {out[key]['padding_waste']:.4f}  shapes {len(shapes):3d}  batches {len(loader)}"
            )
    return out


def parity() -> dict[str, object]:
    """Per-document summed loss of the tiny GPT: every document alone vs packed rows (fp32)."""
    from slipstream.recipe import ShapesConfig
    from slipstream.shapes import ShapedLoader, segment_sum
    from slipstream.workloads.gpt import build_gpt

    data = corpus()
    torch.manual_seed(0)
    model = build_gpt("tiny", max_len=MAX_LEN).eval()
    docs = [
        np.asarray(data.validation[i], dtype=np.int64)
        for i in range(64)
        if 2 <= len(data.validation[i]) <= MAX_LEN + 1
    ]
    cfg = ShapesConfig(mode="pack", max_len=MAX_LEN, tokens_per_batch=4 * MAX_LEN)
    loader = ShapedLoader(docs, cfg, seed=0)
    packed = np.zeros(len(docs))
    with torch.no_grad():
        for plan in loader.plans():
            batch = loader.make_batch(plan)
            per_token = model(**batch, reduction="none")
            B = batch["input_ids"].shape[0]
            n_docs = max(len(r) for r in plan.rows) + 1
            flat_doc = (batch["document_ids"] + n_docs * torch.arange(B)[:, None]).reshape(-1)
            sums = segment_sum(per_token.reshape(-1), flat_doc, B * n_docs).view(B, n_docs)
            for r, row in enumerate(plan.rows):
                for d, seg in enumerate(row):
                    packed[loader.item_seq[seg.item]] = float(sums[r, d])
        alone = np.array(
            [
                float(model(torch.as_tensor(d[:-1])[None], torch.as_tensor(d[1:])[None], reduction="sum"))
                for d in docs
            ]
        )
    diff = float(np.abs(packed - alone).max())
    # per-document mean loss = summed loss / its positions, so this is the max abs diff of the means
    per_token_diff = float(np.max(np.abs(packed - alone) / np.array([len(d) - 1 for d in docs])))
    print(
        f"  packing parity over {len(docs)} documents: max abs diff of per-document mean loss {per_token_diff:.2e} "
        f"(of summed loss {diff:.2e})"
    )
    return {"documents": len(docs), "max_abs_diff_doc_sum": diff, "max_abs_diff_doc_mean": per_token_diff}


def _recompile_child(mode: str, steps: int, tokens_per_batch: int) -> dict[str, object]:
    import slipstream

    spec = f"baseline+shapes.mode={mode}+compile.mode=default+shapes.tokens_per_batch={tokens_per_batch}"
    t0 = time.perf_counter()
    result = slipstream.train("gpt-stdlib", spec, steps, size="tiny", eval_every=0, progress=False)
    m = result.metrics
    from torch._dynamo.utils import counters

    return {
        "recipe": spec,
        "steps": m.steps,
        "distinct_shapes": m.distinct_shapes,
        "recompiles": m.recompiles,
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "first_step_s": round(m.first_step_s, 2),
        "padding_waste": round(m.padding_waste, 4),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def recompiles(steps: int, tokens_per_batch: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for mode in ("bucket", "pad_batch"):
        cmd = [sys.executable, __file__, "--child-recompiles", mode, "--steps", str(steps)]
        cmd += ["--tokens-per-batch", str(tokens_per_batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-4000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = out[mode]
        print(
            f"  {mode:10} {r['steps']} steps: distinct shapes {r['distinct_shapes']}, recompiles {r['recompiles']}, "
            f"first step {r['first_step_s']} s, wall {r['wall_s']} s"
        )
    return out


def throughput(rounds: int, steps_per_round: int, size: str) -> dict[str, object]:
    from slipstream import Session
    from slipstream.presets import resolve_recipe
    from slipstream.workloads.gpt import build_gpt

    data = corpus()
    runners = {}
    for mode in ("pad_max", "bucket", "pack"):
        session = Session(resolve_recipe(f"baseline+shapes.mode={mode}"))
        model = session.prepare_model(build_gpt(size, max_len=MAX_LEN))
        opt = session.build_optimizer(model)
        loader = session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
        runners[mode] = (session, model, opt, loader.forever())

    def run(mode: str) -> tuple[int, float]:
        session, model, opt, batches = runners[mode]
        real = 0
        t0 = time.perf_counter()
        for _ in range(steps_per_round):
            batch = next(batches)
            loss = model(**batch)
            session.backward(loss)
            session.step(opt)
            real += batch.real_tokens
        return real, time.perf_counter() - t0

    per_round: dict[str, list[float]] = {m: [] for m in runners}
    for r in range(rounds + 1):  # round 0 is warm-up
        for mode in runners:
            real, dt = run(mode)
            if r > 0:
                per_round[mode].append(real / dt)
        if r > 0:
            print(
                f"  round {r}: "
                + "  ".join(f"{m} {v[-1]:,.0f}" for m, v in per_round.items())
                + " real tok/s"
            )
    out: dict[str, object] = {"size": size, "rounds": rounds, "steps_per_round": steps_per_round, "modes": {}}
    base = float(np.median(per_round["pad_max"]))
    for mode, vals in per_round.items():
        med = float(np.median(vals))
        out["modes"][mode] = {
            "real_tokens_per_s_median": round(med, 1),
            "real_tokens_per_s_min": round(min(vals), 1),
            "real_tokens_per_s_max": round(max(vals), 1),
            "speedup_vs_pad_max": round(med / base, 3),
            # each round's ratio is side by side in time, so it is robust to load drifting between rounds
            "speedup_per_round": [round(v / b, 3) for v, b in zip(vals, per_round["pad_max"])],
            "speedup_median_of_rounds": round(
                float(np.median([v / b for v, b in zip(vals, per_round["pad_max"])])), 3
            ),
            "per_round_real_tokens_per_s": [round(v, 1) for v in vals],
        }
        print(
            f"  {mode:8} median {med:,.0f} real tok/s  ({min(vals):,.0f}..{max(vals):,.0f})  x{med / base:.2f} vs pad_max"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waste", action="store_true")
    p.add_argument("--parity", action="store_true")
    p.add_argument("--recompiles", action="store_true")
    p.add_argument("--throughput", action="store_true")
    p.add_argument("--all", action="store_true")
    p.add_argument("--steps", type=int, default=200, help="--recompiles: training steps per mode")
    p.add_argument(
        "--tokens-per-batch", type=int, default=2048, help="--recompiles: token budget (small = fast)"
    )
    p.add_argument("--rounds", type=int, default=5, help="--throughput: timed rounds after one warm-up round")
    p.add_argument(
        "--steps-per-round", type=int, default=4, help="--throughput: steps of each mode per round"
    )
    p.add_argument("--size", default="small", help="--throughput: GPT size")
    p.add_argument("--out", help="write the results as JSON here (atomically)")
    p.add_argument("--child-recompiles", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_recompiles:
        print(json.dumps(_recompile_child(args.child_recompiles, args.steps, args.tokens_per_batch)))
        return 0
    result: dict[str, object] = {"benchmark": "shapes", "max_len": MAX_LEN, "machine": machine()}
    if args.waste or args.all:
        print("padding waste, one training epoch:")
        result["padding_waste"] = waste()
    if args.parity or args.all:
        result["packing_parity"] = parity()
    if args.recompiles or args.all:
        print(f"compile on, {args.steps} steps, tiny, tokens_per_batch {args.tokens_per_batch}:")
        result["recompiles"] = recompiles(args.steps, args.tokens_per_batch)
    if args.throughput or args.all:
        print(f"throughput, fp32 eager, {args.size}, interleaved rounds:")
        result["throughput"] = throughput(args.rounds, args.steps_per_round, args.size)
    if args.out:
        from slipstream.files import write_json

        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
