"""The parity guard's power (issue 24): over seeded runs at the default bench budget, how often each
planted fault is flagged "fail" and each harmless recipe "pass", with the band and the detectable
effect of every run.

    python benchmarks/parity_power.py --model gpt --size small --seeds 5 --json out.json
    python benchmarks/parity_power.py --model llama --size small --seeds 5 --json out.json
    python benchmarks/parity_power.py --model gpt --size small --seeds 2 --unpaired   # the seed band

One seeded run is one `run_bench` (every contender at `runtime.seed=S`, default rounds, round
budget and parity steps — at least 100 optimizer steps of the reference —, and bench's null re-runs: the order re-runs only where a verdict rests on them): the reference (baseline), the harmless recipes (bucket, pack with the
mask, foreach AdamW, bf16 — run for its numerics even where it does not pay —, and bucket + bf16,
which changes batching and numerics together) and the planted faults of slipstream.bench.faults
(lr x 3, pack with the document mask dropped, labels shifted by one, pure bf16, the first block
frozen) plus lr x 3 on bucket (`bucket+lr-x3`). Labels for `--only`: bucket, pack,
baseline+optimizer.impl=foreach, bf16, bucket+precision.dtype=bf16, lr-x3, bucket+lr-x3,
no-doc-mask, label-shift, bf16-pure, frozen-layer.

`--model llama` is a Hugging Face LlamaForCausalLM built from a config (4 layers, d=256 for
`small`; 2 layers, d=64 for `tiny`) on the gpt-stdlib documents re-tokenized with a byte-level BPE
(2,048 tokens) trained here on the training documents: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import cache
from pathlib import Path

import numpy as np

# this folder's kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from slipstream.bench.faults import fault_contenders, lr_times  # noqa: E402
from slipstream.bench.runner import run_bench  # noqa: E402
from slipstream.doctor import machine_info  # noqa: E402
from slipstream.files import write_json  # noqa: E402
from slipstream.workloads import get_workload  # noqa: E402
from slipstream.workloads.registry import WORKLOADS, Workload, WorkloadData, register_workload  # noqa: E402

HARMLESS = ("bucket", "pack", "baseline+optimizer.impl=foreach", "bf16", "bucket+precision.dtype=bf16")
"""The reference's `optimizer.impl=auto` picks fused AdamW by timing on these hosts (0.18 ms a step vs
foreach 2.97 ms, GPT tiny, host B), so the harmless optimizer change is foreach: `impl=fused` would be
the reference itself. The last recipe changes batching and numerics together: judged by its numerics
twin (docs/bench.md)."""
LLAMA_VOCAB = 2048
LLAMA_SIZES = {"tiny": (64, 172, 2, 2, 1), "small": (256, 688, 4, 4, 2)}
"""size -> (hidden, intermediate, layers, heads, kv heads)."""


@cache
def _llama_data() -> WorkloadData:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from slipstream.workloads.corpus import decode, load_stdlib_corpus

    corpus = load_stdlib_corpus()
    train = [decode(corpus.train[i]) for i in range(len(corpus.train))]
    val = [decode(corpus.validation[i]) for i in range(len(corpus.validation))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LLAMA_VOCAB, special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(train[:2000], trainer)
    eos = tok.token_to_id("<|endoftext|>")

    def ids(texts):
        return [np.array([*e.ids, eos], dtype=np.int64) for e in tok.encode_batch(texts)]

    tr, va = ids(train), ids(val)
    return WorkloadData(
        train=tr, validation=va, train_lengths=np.array([len(x) for x in tr]),
        validation_lengths=np.array([len(x) for x in va]), pad_id=0, vocab_size=tok.get_vocab_size(),
    )  # fmt: skip


def _llama_model(size: str, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = LLAMA_SIZES[size]
    cfg = LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_len,
        bos_token_id=1, eos_token_id=1, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def workload(model: str) -> str:
    if model == "gpt":
        return "gpt-stdlib"
    name = "parity-hf-llama"
    if name not in WORKLOADS:
        desc = "HF LlamaForCausalLM from a config on gpt-stdlib re-tokenized (local BPE)"
        register_workload(Workload(name, desc, tuple(LLAMA_SIZES), _llama_model, _llama_data))
    return name


def one_run(wl: str, size: str, seed: int, args) -> dict:
    extra = f"+runtime.seed={seed}{args.set}"
    ref = f"baseline{extra}"
    harmless = [h.split("+")[0] + extra + "".join("+" + o for o in h.split("+")[1:]) for h in HARMLESS]
    faults, custom = fault_contenders(extra)
    recipes = [ref, *harmless, lr_times(ref, 3.0), lr_times(f"bucket{extra}", 3.0), *faults]
    if args.only:  # a subset, by label (the reference always runs)
        keep = set(args.only.split(","))
        recipes = [ref] + [r for r in recipes[1:] if _label(r, extra) in keep]
    t0 = time.perf_counter()
    res = run_bench(
        wl, recipes, size=size, rounds=args.rounds, memory="skip", noise_seeds=args.noise_seeds,
        min_dtype_speed=None, custom=custom, paired=not args.unpaired, window_tokens=args.window_tokens,
        parity_steps=args.parity_steps, precision_seeds=args.precision_seeds,
        numerics_seeds=args.numerics_seeds,
        progress=(lambda m: print(m, file=sys.stderr, flush=True)) if args.verbose else None,
    ).to_dict()  # fmt: skip
    m = res["method"]
    rows = []
    for c in res["contenders"]:
        label = _label(c["name"], extra)
        kind = "reference" if c["name"] == ref else "harmless" if label in HARMLESS else "fault"
        rows.append({
            "label": label, "kind": kind, "val_loss": c["val_loss"], "parity_gap": c["parity_gap"],
            "parity": c["parity"], "parity_sampling_error": c.get("parity_sampling_error"),
            "band_kind": c.get("parity_band_kind"), "tolerance": c.get("parity_tolerance"),
            "detectable_effect": c.get("parity_detectable_effect"), "steps": c["steps"],
            "real_tokens": c["real_tokens"], "batching_check": c.get("batching_check"),
            "curve_check": c.get("curve_check"), "parity_twin": c.get("parity_twin"),
            "update_check": c.get("update_check"),
        })  # fmt: skip
    return {
        "seed": seed,
        "wall_s": time.perf_counter() - t0,
        "steps": res["contenders"][0]["steps"],
        "rounds": m["rounds"],
        "real_tokens": res["contenders"][0]["real_tokens"],
        "band": {
            k: m.get(k)
            for k in (
                "parity_design",
                "parity_tolerance",
                "parity_noise_band",
                "parity_band_source",
                "parity_detectable_effect",
                "parity_null_sigma",
                "parity_noise_val_losses",
                "parity_curve_band",
                "parity_precision_bands",
                "parity_window_tokens",
                "val_real_tokens",
                "real_tokens_per_step",
            )
        },  # fmt: skip
        "contenders": rows,
    }


def _twin_words(twin: dict | None) -> str:
    if not twin:
        return ""
    curve = twin.get("curve_check") or {}
    gap = "-" if twin["gap"] is None else f"{twin['gap']:.3%}"
    curve_gap = f", curve gap {curve['gap']:.3%}" if curve.get("gap") is not None else ""
    return f"; twin {twin['verdict']} (gap {gap}{curve_gap})"


def _update_words(row: dict | None) -> str:
    if not row or row.get("median_error") is None:
        return ""
    return f"; update error {row['median_error']:.2%} of {row['tolerance']:.2%}"


def _label(name: str, extra: str) -> str:
    """A contender's name without the run's overrides: the row it is summarised under."""
    if "optimizer.lr=" in name:  # lr x 3 on the reference, or on bucket (batching and numerics)
        return "bucket+lr-x3" if name.startswith("bucket") else "lr-x3"
    return name.split("@")[0] if "@" in name else name.replace(extra, "")


def summarise(runs: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for run in runs:
        for c in run["contenders"]:
            s = out.setdefault(c["label"], {"kind": c["kind"], "runs": 0, "pass": 0, "fail": 0, "unjudged": 0,
                                            "gaps": []})  # fmt: skip
            s["runs"] += 1
            if c["parity"] in ("pass", "fail", "unjudged"):
                s[c["parity"]] += 1
            s["gaps"].append(c["parity_gap"])
            update = (c.get("update_check") or {}).get("median_error")
            if update is not None:
                s.setdefault("update_errors", []).append(update)
    for s in out.values():
        s["median_gap"] = float(np.median(s["gaps"]))
        s["max_gap"] = float(np.max(s["gaps"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--size", default="small")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--noise-seeds",
        type=int,
        default=None,
        help="bench's --noise-seeds (default as bench: 2 order re-runs only where a verdict rests on them)",
    )
    ap.add_argument(
        "--precision-seeds", type=int, default=None, help="bench's --precision-seeds (default 2 where needed)"
    )
    ap.add_argument(
        "--numerics-seeds", type=int, default=None, help="bench's --numerics-seeds (default 1 where needed)"
    )
    ap.add_argument("--parity-steps", type=int, default=None, help="bench's --parity-steps (default 100)")
    ap.add_argument("--unpaired", action="store_true", help="the seed-band design, for comparison")
    ap.add_argument("--set", default="", help="extra +section.field=value overrides for every recipe")
    ap.add_argument("--window-tokens", type=int, default=None, help="paired windows (default: one round)")
    ap.add_argument("--only", default="", help="comma-separated labels to run beside the reference")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    wl = workload(args.model)
    get_workload(wl).load_data()  # tokenize once, outside the timed runs
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run = one_run(wl, args.size, seed, args)
        runs.append(run)
        b = run["band"]
        de = b["parity_detectable_effect"]
        print(
            f"seed {seed}: {run['wall_s']:.0f} s, {run['steps']} steps; band {b['parity_tolerance']:.3%}, "
            f"detectable {'-' if de is None else f'{de:.3%}'}, null sigma {b['parity_null_sigma']}",
            flush=True,
        )
        for c in run["contenders"]:
            de = c["detectable_effect"]
            curve = c.get("curve_check") or {}
            print(
                f"  {c['label']:30} {c['kind']:9} gap {c['parity_gap']:.3%} {c['parity']:9} "
                f"band {c['band_kind']} {'-' if c['tolerance'] is None else format(c['tolerance'], '.3%')} "
                f"detects {'-' if de is None else f'{de:.3%}'}"
                + (
                    f"; curve gap {curve['gap']:.3%} of {curve['tolerance']:.3%}"
                    if curve.get("gap") is not None
                    else ""
                )
                + _update_words(c.get("update_check"))
                + _twin_words(c.get("parity_twin")),
                flush=True,
            )
        if args.json:  # after every seed: an interrupted experiment keeps what it measured
            payload = {
                "benchmark": "parity_power", "workload": wl, "model": args.model, "size": args.size,
                "command": "python benchmarks/parity_power.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "machine": machine_info(), "design": "seeds" if args.unpaired else "paired",
                "summary": summarise(runs), "runs": runs,
            }  # fmt: skip
            write_json(Path(args.json), payload)
    for label, s in summarise(runs).items():
        print(f"{label:30} {s['kind']:9} pass {s['pass']}/{s['runs']} fail {s['fail']}/{s['runs']} "
              f"unjudged {s['unjudged']}/{s['runs']} median gap {s['median_gap']:.3%}"
              + (f"; update error {min(s['update_errors']):.2%}-{max(s['update_errors']):.2%}"
                 if s.get("update_errors") else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
