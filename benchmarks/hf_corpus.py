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
import re
from pathlib import Path

from hf_models import VOCAB


def copyright_texts(root: Path = Path("/usr/share/doc")) -> list[str]:
    texts = []
    for path in sorted(root.glob("*/copyright")):
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (UnicodeDecodeError, OSError):
            continue
        texts += [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return texts


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: what hf_models' configs name
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
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
