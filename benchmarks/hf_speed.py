"""Real tokens/s of slipstream recipes on a Hugging Face model, each timed for a fixed wall time.

A quick side-by-side of specs (no peers, no parity: `slipstream bench` does those):

    python benchmarks/hf_speed.py --data /tmp/hfbench/corpus.jsonl --tokenizer /tmp/hfbench/tok \\
        "pack+shapes.max_len=512" "pack+shapes.max_len=512+kernels.ops=auto" \\
        "pack+shapes.max_len=512+kernels.ops=auto+compile.mode=default"

Each spec gets a fresh model (same seed), 3 untimed steps (compilation happens there), then as many
steps as fit in --seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks import hf_models  # noqa: E402

from slipstream import Session  # noqa: E402
from slipstream.models import loss_of  # noqa: E402
from slipstream.workloads import get_workload  # noqa: E402
from slipstream.workloads.user import user_workload_name  # noqa: E402


def time_spec(spec: str, data, model_name: str, seconds: float) -> str:
    torch.manual_seed(0)
    session = Session(spec)
    model = session.prepare_model(getattr(hf_models, model_name)())
    opt = session.build_optimizer(model)
    loader = session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
    batches = loader.forever()

    def step() -> int:
        batch = next(batches)
        with session.autocast():
            loss = loss_of(model(**batch))
        session.backward(loss)
        session.step(opt)
        return batch.real_tokens

    for _ in range(3):
        step()
    real, steps, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        real += step()
        steps += 1
    secs = time.perf_counter() - t0
    return (
        f"{spec}: {real / secs:,.0f} real tok/s over {steps} steps, padding waste "
        f"{loader.padding_waste():.3f}, kernels {session.metrics().extra.get('kernels_swapped')}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--model", default="gpt2_small")
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--seconds", type=float, default=25.0)
    args = ap.parse_args(argv)
    name = user_workload_name(
        model=f"benchmarks.hf_models:{args.model}", data=args.data, tokenizer=args.tokenizer
    )
    data = get_workload(name).load_data()
    for spec in args.specs:
        print(time_spec(spec, data, args.model, args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
