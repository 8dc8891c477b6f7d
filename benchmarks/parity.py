"""The parity guard on gpt-stdlib: the seed noise band it measures, and that it tells apart changes
that keep the training (bf16, bucket) from ones that break it (lr x 10; packing without the
document mask, where packed documents attend to each other).

    python benchmarks/parity.py --size small --rounds 3 --json benchmarks/results/parity-....json

Every contender runs at the reference's real tokens per optimizer step for the same real tokens
(`slipstream bench`'s method); bf16 runs even where it does not pay (numerics, not speed, is the
question here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slipstream.bench.runner import RecipeContender, custom_factory, run_bench
from slipstream.files import write_json  # noqa: E402


class PackWithoutDocumentMask(RecipeContender):
    """`pack`, but the model never sees document_ids: packed documents attend to one another, as a
    model that silently drops the mask would (a Hugging Face model fed `document_ids` does)."""

    def train_step(self, batch):
        unmasked = type(batch)({k: v for k, v in batch.items() if k != "document_ids"})
        return super().train_step(unmasked)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-tokens", type=int)
    ap.add_argument("--noise-seeds", type=int, default=2)
    ap.add_argument("--set", default="", help="extra +section.field=value overrides for every recipe")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    extra = args.set
    broken = f"pack-no-mask@pack{extra}"
    recipes = [
        f"baseline{extra}",
        f"bf16{extra}",
        f"bucket{extra}",
        f"pack{extra}",
        f"baseline{extra}+optimizer.lr=0.01",
        broken,
    ]

    result = run_bench(
        "gpt-stdlib",
        recipes,
        size=args.size,
        rounds=args.rounds,
        round_tokens=args.round_tokens,
        memory="skip",
        noise_seeds=args.noise_seeds,
        min_dtype_speed=None,
        custom={broken: custom_factory(PackWithoutDocumentMask)},
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    ).to_dict()
    m = result["method"]
    print(f"noise band {m['parity_noise_band']:.3%} from val losses {m['parity_noise_val_losses']}")
    print(f"allowed gap {m['parity_tolerance']:.3%}")
    for c in result["contenders"]:
        print(f"{c['name']:45} val {c['val_loss']:.4f} gap {c['parity_gap']:.3%} {c['parity']}")
    payload = {"benchmark": "parity", **result}
    payload["contenders"] = [{k: v for k, v in c.items() if k != "loss_curve"} for c in result["contenders"]]
    if args.json:
        write_json(Path(args.json), payload)
        print(f"wrote {args.json}")
    else:
        print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
