"""Does a Hugging Face model trained through slipstream learn what a plain Hugging Face loop learns?

For each model (GPT-2 and Llama-style, benchmarks/hf_models.py) and the same corpus and tokenizer:

- `plain` — what a Hugging Face user writes: random batches of documents padded to the batch's
  longest with an `attention_mask`, labels = input_ids with -100 at padding, AdamW, grad clip 1.0,
  fp32; run with seeds 0, 1, 2 (init and data order): their spread is the noise band;
- `slipstream` — `Session(recipe)` (default `auto`: packing or buckets, fused LM head, dtype by the
  probe) with seed 0, its batches rescaled to the plain loop's mean real tokens per optimizer step
  (`slipstream.bench.runner.matched_loader`: otherwise fewer, fuller steps would be compared).

Every run trains `--steps` steps; the verdicts are slipstream.parity's: the final 20-step mean of the
training loss against the plain seed-0 curve (band = the seeds' spread), and the validation loss on
the same held-out documents.

    python benchmarks/hf_parity.py --data /tmp/hfbench/corpus.jsonl --tokenizer /tmp/hfbench/tok \
        --json benchmarks/results/hf-parity-<date>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks import hf_models  # noqa: E402

from slipstream import Session  # noqa: E402
from slipstream.bench.contenders import matched_loader  # noqa: E402
from slipstream.bench.hf_peers import pad_batch  # noqa: E402
from slipstream.doctor import machine_info  # noqa: E402
from slipstream.files import write_json  # noqa: E402
from slipstream.models import loss_of  # noqa: E402
from slipstream.parity import judge_parity, noise_band, parity  # noqa: E402
from slipstream.recipe import OptimizerConfig  # noqa: E402
from slipstream.workloads import get_workload  # noqa: E402
from slipstream.workloads.user import user_workload_name  # noqa: E402


def padded(docs: list[np.ndarray], pad_id: int) -> dict[str, torch.Tensor]:
    """The plain way: pad to the batch's longest with an attention_mask, -100 at padding."""
    return pad_batch([{"input_ids": d} for d in docs], pad_id)


@torch.no_grad()
def validation_loss(model, docs: list[np.ndarray], pad_id: int, rows: int = 8) -> float:
    """Token-weighted loss over the held-out documents, padded batches with a mask (the plain way)."""
    model.eval()
    total = tokens = 0.0
    for i in range(0, len(docs), rows):
        batch = padded(docs[i : i + rows], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(loss_of(model(**batch))) * n
        tokens += n
    model.train()
    return total / tokens


def plain_run(factory, train, val, pad_id, seed, steps, docs_per_step, max_len, opt_cfg):
    torch.manual_seed(seed)
    model = factory()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    losses, real = [], 0
    t0 = time.perf_counter()
    for _ in range(steps):
        docs = [np.asarray(train[int(i)])[:max_len] for i in rng.choice(len(train), docs_per_step)]
        batch = padded(docs, pad_id)
        real += int((batch["labels"][:, 1:] != -100).sum())
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    secs = time.perf_counter() - t0
    return {
        "loss": losses,
        "val_loss": validation_loss(model, val, pad_id),
        "real_tokens": real,
        "real_tokens_per_s": real / secs,
    }


def slipstream_run(factory, data, val, recipe, steps, target, max_len):
    session = Session(recipe)
    model = session.prepare_model(factory())
    opt = session.build_optimizer(model, total_steps=steps)

    def build(tokens_per_batch):
        return session.prepare_loader(
            data.train, tokens_per_batch, lengths=data.train_lengths, pad_id=data.pad_id
        )

    loader = matched_loader(build, session.recipe.shapes.tokens_per_batch, target, max_len)
    losses, real = [], 0
    t0 = time.perf_counter()
    for _, batch in zip(range(steps), loader.forever()):
        with session.autocast():
            loss = loss_of(model(**batch))
        session.backward(loss)
        session.step(opt)
        real += batch.real_tokens
        losses.append(float(loss))
    secs = time.perf_counter() - t0
    base = getattr(model, "_orig_mod", model)
    return {
        "loss": losses,
        "val_loss": validation_loss(base, val, data.pad_id),
        "real_tokens": real,
        "real_tokens_per_s": real / secs,
        "decisions": session.decisions,
        "padding_waste": loader.padding_waste(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--models", default="gpt2_small,llama_small")
    ap.add_argument("--recipe", default="auto")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens-per-step", type=int, default=1024, help="about this many real tokens per step")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--val-docs", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    opt_cfg = OptimizerConfig()
    out: dict = {"machine": machine_info(), "args": vars(args), "models": {}}
    for name in args.models.split(","):
        factory = getattr(hf_models, name)
        wl = get_workload(
            user_workload_name(model=f"benchmarks.hf_models:{name}", data=args.data, tokenizer=args.tokenizer)
        )
        data = wl.load_data()
        val = [
            np.asarray(data.validation[i])[: args.max_len]
            for i in range(min(args.val_docs, len(data.validation)))
        ]
        mean_pred = float(np.mean(np.minimum(data.train_lengths, args.max_len) - 1))
        docs_per_step = max(1, round(args.tokens_per_step / mean_pred))
        target = docs_per_step * mean_pred
        runs = {}
        for seed in (0, 1, 2):
            print(f"{name}: plain seed {seed}", flush=True)
            runs[f"plain-seed{seed}"] = plain_run(
                factory,
                data.train,
                val,
                data.pad_id,
                seed,
                args.steps,
                docs_per_step,
                args.max_len,
                opt_cfg,
            )
        print(f"{name}: slipstream {args.recipe}", flush=True)
        recipe = f"{args.recipe}+shapes.max_len={args.max_len}+shapes.tokens_per_batch={args.tokens_per_step}"
        runs["slipstream"] = slipstream_run(factory, data, val, recipe, args.steps, target, args.max_len)
        ref, noise = runs["plain-seed0"], [runs["plain-seed1"], runs["plain-seed2"]]
        curve = parity(runs["slipstream"]["loss"], ref["loss"], noise_curves=[r["loss"] for r in noise])
        band = noise_band([r["val_loss"] for r in (ref, *noise)])
        verdict, gap, allowed = judge_parity(runs["slipstream"]["val_loss"], ref["val_loss"], band)
        out["models"][name] = {
            "docs_per_step": docs_per_step,
            "target_real_tokens_per_step": target,
            "runs": runs,
            "train_curve_parity": {
                "passed": curve.passed,
                "gap": curve.gap,
                "tolerance": curve.tolerance,
                "reason": curve.reason,
            },
            "val_parity": {"verdict": verdict, "gap": gap, "allowed": allowed},
        }
        print(
            f"{name}: real tokens plain {ref['real_tokens']:,} / slipstream {runs['slipstream']['real_tokens']:,}; "
            f"train-curve {curve.reason}; validation "
            f"{runs['slipstream']['val_loss']:.4f} vs plain {ref['val_loss']:.4f} (seeds "
            f"{', '.join(format(r['val_loss'], '.4f') for r in noise)}): gap {gap:.2%}, allowed {allowed:.2%} -> {verdict}",
            flush=True,
        )
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
