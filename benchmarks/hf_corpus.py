"""A real variable-length text corpus and a locally trained tokenizer for the HF benchmarks.

Documents are the paragraphs (blank-line separated) of the Debian copyright files under
/usr/share/doc: headers of a few tokens next to whole license texts, the skew where padding wastes
most. The tokenizer is a byte-level BPE
of 8,192 tokens trained on them with `tokenizers` (no download), saved as a transformers folder.

    python benchmarks/hf_corpus.py --out /tmp/hfbench      # writes corpus.jsonl and tok/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.hf_models import VOCAB  # noqa: E402

from slipstream.workloads.corpus import copyright_paragraphs as copyright_texts  # noqa: E402


def train_tokenizer(texts: list[str], out: Path, extra_specials: tuple[str, ...] = ()) -> None:
    """`extra_specials` are added after the three fixed ones (e.g. chat markers), each one id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", *extra_specials]  # ids 0, 1, 2: what hf_models' configs name
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(extra_specials) or None,
    )
    fast.save_pretrained(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/hfbench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = copyright_texts()
    with open(out / "corpus.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    train_tokenizer(texts, out / "tok")
    print(f"{len(texts)} documents, {sum(map(len, texts)):,} characters -> {out}/corpus.jsonl, {out}/tok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
