"""Shared by the user-workload and export tests: tiny text, a locally trained tokenizer, and model
modules written into a temp folder (nothing is downloaded)."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while alpha beta gamma delta sleep".split()


def paragraphs(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def write_text(path: Path, n: int = 40) -> Path:
    path.write_text("\n\n".join(paragraphs(n)) + "\n")
    return path


def train_tokenizer(folder: Path, with_config: bool = True) -> Path:
    """A byte-level BPE trained on the test words; saved as transformers would (or bare tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(paragraphs(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    if not with_config:
        tok.save(str(folder / "tokenizer.json"))
        return folder
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return folder


def write_module(folder: Path, body: str) -> str:
    """Write `body` as a uniquely named module in `folder`; returns the module name."""
    name = f"usermod_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(body)
    return name


GPT2_FACTORY = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size={vocab}, n_positions=64, n_embd=32, n_layer=1, n_head=2))
"""
