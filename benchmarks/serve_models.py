"""The model the OpenAI-serving benchmark serves: a Llama-style causal LM trained here, saved with
`save_pretrained` (config, safetensors weights, tokenizer, chat template, generation config).

Nothing is downloaded. The corpus and tokenizer are benchmarks/hf_corpus.py's (paragraphs of the
Debian copyright files, an 8,192-token byte-level BPE trained on them, plus the two ChatML markers
as special tokens); the model is benchmarks/hf_models.py's `llama_small` (4 layers, d=256). It is
trained briefly (`--steps 200`: ~150 s on 2 idle cores) with a plain AdamW loop on random
128-token windows of the packed corpus, a quarter of the paragraphs rendered as a ChatML exchange
(the first half of the paragraph as the user's turn, the rest as the assistant's), so that both
`/v1/completions` and `/v1/chat/completions` produce text rather than one repeated token. The
corpus has no EOS, so completions run to max_tokens (equal work per request for every server);
chat answers end at <|im_end|>. The script refuses to save a model whose greedy continuations are
degenerate (ending at once, or one token repeated).

    python benchmarks/serve_models.py --out /tmp/servebench/llama

The folder then holds what `transformers serve DIR` and `slipstream serve --model DIR` load, and
`train.json` (steps, losses, sample continuations).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.hf_corpus import train_tokenizer  # noqa: E402
from benchmarks.hf_models import llama_small  # noqa: E402

from slipstream.workloads.corpus import copyright_paragraphs  # noqa: E402

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen and others write it; the markers are single special tokens of the tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def as_chat(text: str) -> str:
    """A paragraph as a one-turn ChatML exchange: its first half asks, the rest answers."""
    words = text.split()
    cut = max(1, len(words) // 2)
    return (
        f"{IM_START}user\n{' '.join(words[:cut])}{IM_END}\n"
        f"{IM_START}assistant\n{' '.join(words[cut:])}{IM_END}\n"
    )


def token_streams(tok, texts: list[str], chat_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The corpus as two arrays of ids: plain paragraphs separated by a blank line, as in the
    files, and (`chat_share` of the paragraphs) ChatML exchanges one after another. Kept apart so
    that plain text is never followed by chat markers. No EOS: a completion runs to its max_tokens
    (a serving benchmark then compares equal work, as vLLM's does with ignore_eos), while a chat
    answer ends at <|im_end|>, which the generation config stops on."""
    rng = np.random.default_rng(seed)
    chat = rng.random(len(texts)) < chat_share
    plain_ids = tok([t + "\n\n" for t, c in zip(texts, chat) if not c], add_special_tokens=False)["input_ids"]
    chat_ids = tok([as_chat(t) for t, c in zip(texts, chat) if c], add_special_tokens=False)["input_ids"]
    return tuple(np.fromiter((i for d in ids for i in d), dtype=np.int64) for ids in (plain_ids, chat_ids))


def train(model, streams: tuple[np.ndarray, np.ndarray], args) -> dict:
    """Random `--seq`-token windows of the packed streams (`--chat-share` of each batch's rows from
    the chat one); AdamW, linear warm-up, cosine decay to 10%, grad clip 1; stops at `--steps` or
    `--train-s`, whichever comes first."""
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        if time.perf_counter() - t0 > args.train_s:
            break
        warm = min(1.0, (step + 1) / 20)
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * decay
        n_chat = round(args.batch * args.chat_share)
        rows = []
        for stream, n in zip(streams, (args.batch - n_chat, n_chat)):
            starts = torch.randint(0, len(stream) - args.seq - 1, (n,), generator=g).tolist()
            rows += [stream[s : s + args.seq] for s in starts]
        x = torch.from_numpy(np.stack(rows))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0:
            print(f"step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    return {"steps": len(losses), "train_s": time.perf_counter() - t0, "losses": losses}


@torch.no_grad()
def samples(model, tok, prompts: list[str], new_tokens: int = 24) -> list[dict]:
    """Greedy continuations through the model's own generate (the EOS set of its generation config)."""
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
        out.append({"prompt": p, "tokens": gen, "text": tok.decode(gen, skip_special_tokens=False)})
    return out


def degenerate(rows: list[dict]) -> str | None:
    """Why these continuations are degenerate, or None: empty/EOS-only, or one token repeated."""
    tokens = [t for r in rows for t in r["tokens"]]
    if sum(len(r["tokens"]) for r in rows) < 2 * len(rows):
        return "continuations end at once (EOS / <|im_end|>)"
    if len(set(tokens)) < 5:
        return f"only {len(set(tokens))} distinct tokens across {len(rows)} continuations"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/servebench/llama")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--train-s", type=float, default=300.0, help="stop early past this wall time (seconds)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--chat-share", type=float, default=0.25, help="paragraphs (and rows) as ChatML")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = copyright_paragraphs()
    t0 = time.perf_counter()
    train_tokenizer(texts, out, extra_specials=(IM_START, IM_END))
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    print(f"tokenizer: {len(tok)} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)
    streams = token_streams(tok, texts, args.chat_share, args.seed)
    print(f"{len(texts)} paragraphs -> {len(streams[0]):,} + {len(streams[1]):,} (chat) tokens", flush=True)

    torch.manual_seed(args.seed)
    model = llama_small()
    assert model.config.vocab_size >= len(tok), (model.config.vocab_size, len(tok))
    # Stop at EOS or at the end of an assistant turn; pad is id 0 (hf_models' config).
    model.generation_config.eos_token_id = [eos, im_end]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    log = train(model, streams, args)
    rows = samples(
        model,
        tok,
        [texts[i][:120] for i in (0, 100, 1000, 5000)]
        + [
            tok.apply_chat_template(
                [{"role": "user", "content": "Permission is hereby granted"}],
                tokenize=False,
                add_generation_prompt=True,
            )
        ],
    )
    for r in rows:
        print(f"{r['prompt'][:60]!r} -> {r['text']!r}", flush=True)
    bad = degenerate(rows)
    if bad:
        print(f"refusing to save: {bad}; train longer (--train-s, --steps)", file=sys.stderr)
        return 1
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    first, last = np.mean(log["losses"][:10]), np.mean(log["losses"][-10:])
    (out / "train.json").write_text(
        json.dumps(
            {
                "model": "benchmarks.hf_models:llama_small",
                "parameters": sum(p.numel() for p in model.parameters()),
                "corpus_paragraphs": len(texts),
                "corpus_tokens": len(streams[0]) + len(streams[1]),
                "loss_first10": first,
                "loss_last10": last,
                "samples": rows,
                "torch": torch.__version__,
                **{k: v for k, v in vars(args).items() if k != "out"},
                **log,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{log['steps']} steps in {log['train_s']:.0f} s, loss {first:.2f} -> {last:.2f}; saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
