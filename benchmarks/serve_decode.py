"""Decode-step cost of `slipstream serve`'s generator on this machine, side by side in one run.

    python benchmarks/serve_decode.py --model /tmp/servebench/llama --slots 8,16,32 --threads 1
    python benchmarks/serve_decode.py --model /tmp/servebench/llama --loop --slots 8 --threads 1,2

Default: the median milliseconds of one decode step (every slot busy, positions 60-120) eager and
under `torch.compile` (`--compile-decode`), per slot count. `--loop`: the whole generator
(continuous batching, prefill included) in-process: 48 prompts of 256 characters, 64 greedy tokens
each, output tokens/s per torch thread count. Nothing else should run while it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from slipstream.serve.decoder import Decoder  # noqa: E402
from slipstream.serve.generate import Generator, GeneratorConfig  # noqa: E402
from slipstream.serve.model import load_hf_model  # noqa: E402


def step_ms(loaded, slots: int, compile: bool, reps: int = 30) -> float:
    dec = Decoder(loaded, slots, compile=compile)
    tokens = torch.full((slots,), 5)
    positions = torch.randint(60, 120, (slots,), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for _ in range(3):  # compiles (when compiled), then warms
            dec.decode_one_token(tokens, positions)
        for _ in range(reps):
            t0 = time.perf_counter()
            dec.decode_one_token(tokens, positions)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def loop_tokens_per_s(loaded, slots: int, n_prompts: int = 48, new_tokens: int = 64) -> float:
    from slipstream.workloads.corpus import copyright_paragraphs

    prompts = [loaded.codec.encode(p[:256]) for p in copyright_paragraphs()[:n_prompts]]

    async def main():
        gen = Generator(loaded, GeneratorConfig(slots=slots))
        await gen.start(warmup=True)

        async def one(p):
            stream = await gen.submit(p, max_new_tokens=new_tokens, stop_at_eos=False)
            return sum([1 async for _ in stream])

        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*[one(p) for p in prompts]))
        wall = time.perf_counter() - t0
        await gen.drain(5)
        return n / wall

    return asyncio.run(main())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="save_pretrained folder")
    p.add_argument("--slots", default="8,16,32")
    p.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--loop", action="store_true", help="measure the whole generator loop instead")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    loaded = load_hf_model(args.model, max_len=args.max_len)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for slots in (int(s) for s in args.slots.split(",")):
            if args.loop:
                row = {"threads": threads, "slots": slots, "tokens_per_s": loop_tokens_per_s(loaded, slots)}
                print(f"threads {threads} slots {slots}: {row['tokens_per_s']:.0f} output tok/s", flush=True)
            else:
                eager, compiled = step_ms(loaded, slots, False), step_ms(loaded, slots, True)
                row = {"threads": threads, "slots": slots, "eager_ms": eager, "compiled_ms": compiled}
                print(
                    f"threads {threads} slots {slots}: eager {eager:.2f} ms, compiled {compiled:.2f} ms",
                    flush=True,
                )
            rows.append(row)
    if args.json:
        from benchmarks.serve_openai import host_info

        out = {"benchmark": "serve-decode-step", "model": args.model, "machine": host_info(), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
