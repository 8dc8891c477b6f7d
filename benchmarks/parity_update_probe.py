"""Why the update check takes one step and takes the median over tensors (issue 24; docs/bench.md).

Trains the built-in GPT for `steps` steps in fp32 (the `baseline` recipe at max_len 256), then from
its final weights and optimizer state takes k optimizer steps on the same random training batches
four ways: fp32 (the reference), fp32 with the rows of each batch permuted, bf16 autocast, and pure
bf16 weights (`model.to(bfloat16)`, the planted fault). Prints, per way and k, the relative error of
the whole weight change against the reference's, the median and the worst tensors' errors.

    python benchmarks/parity_update_probe.py --size small --steps 100 --seed 1 --k 1,8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shutil
import tempfile

import numpy as np
import torch

from slipstream import train
from slipstream.presets import resolve_recipe
from slipstream.session import Session
from slipstream.workloads.registry import get_workload

MAX_LEN = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", default="1,8", help="step counts to compare, comma-separated")
    ap.add_argument("--batch-rows", type=int, default=16)
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    spec = f"baseline+runtime.seed={args.seed}+shapes.max_len={MAX_LEN}"
    ck = tempfile.mkdtemp(prefix="update-probe-")
    try:
        torch.manual_seed(args.seed)
        train("gpt-stdlib", spec, args.steps, size=args.size, eval_every=0, checkpoint_dir=ck,
              checkpoint_every=args.steps, progress=False)  # fmt: skip
        state = torch.load(f"{ck}/checkpoint.pt", map_location="cpu", weights_only=False)
    finally:
        shutil.rmtree(ck, ignore_errors=True)
    wl = get_workload("gpt-stdlib")
    data = wl.load_data()
    rng = np.random.default_rng(args.seed)

    def batch(rows):
        ids = torch.full((len(rows), MAX_LEN), data.pad_id)
        labels = torch.full((len(rows), MAX_LEN), -100)
        for i, j in enumerate(rows):
            s = np.asarray(data.train[j])[: MAX_LEN + 1]
            ids[i, : len(s) - 1], labels[i, : len(s) - 1] = torch.as_tensor(s[:-1]), torch.as_tensor(s[1:])
        return ids, labels

    batches = [batch(rng.choice(len(data.train), args.batch_rows, replace=False)) for _ in range(max(ks))]

    def change(way: str, k: int) -> dict[str, torch.Tensor]:
        model = wl.model(args.size, MAX_LEN)
        model.load_state_dict(state["model"])
        if way == "pure bf16":
            model.to(torch.bfloat16)
        opt = Session(resolve_recipe(spec)).build_optimizer(model)
        opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        autocast = way == "bf16 autocast"
        rows = torch.Generator().manual_seed(1)
        for ids, labels in batches[:k]:
            if way == "fp32 rows permuted":
                perm = torch.randperm(ids.shape[0], generator=rows)
                ids, labels = ids[perm], labels[perm]
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                out = model(input_ids=ids, labels=labels)
            getattr(out, "loss", out).float().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().float() - before[n] for n, p in model.named_parameters()}

    for k in ks:
        ref = change("fp32", k)
        flat_ref = torch.cat([v.reshape(-1) for v in ref.values()])
        for way in ("fp32 rows permuted", "bf16 autocast", "pure bf16"):
            d = change(way, k)
            flat = torch.cat([v.reshape(-1) for v in d.values()])
            per = {n: float((d[n] - r).norm() / r.norm()) for n, r in ref.items() if r.norm() > 0}
            worst = sorted(per.items(), key=lambda kv: -kv[1])[:3]
            print(
                f"GPT {args.size} seed {args.seed} after {args.steps} steps, k={k}, {way:18}: whole change "
                f"{float((flat - flat_ref).norm() / flat_ref.norm()):.3e}, median tensor "
                f"{float(np.median(list(per.values()))):.3e}, worst "
                + ", ".join(f"{n} {e:.3f}" for n, e in worst),
                flush=True,
            )


if __name__ == "__main__":
    main()
