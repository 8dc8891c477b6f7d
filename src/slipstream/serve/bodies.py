"""Request bodies for load tests: slipstream score / generate payloads from the gpt-stdlib
validation split, and OpenAI completions / chat bodies over prompts from a file or local text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..recipe import RecipeError


def validation_payloads(
    max_tokens: int = 1024,
    n: int | None = None,
    endpoint: str = "score",
    max_new_tokens: int = 32,
    prompt_tokens: int = 64,
) -> list[dict]:
    """Request bodies from the gpt-stdlib validation split (realistic, skewed lengths)."""
    from ..workloads.corpus import load_stdlib_corpus

    val = load_stdlib_corpus().validation
    count = len(val) if n is None else min(n, len(val))
    out = []
    for i in range(count):
        doc = np.asarray(val[i], dtype=np.int64)
        if endpoint == "generate":
            out.append(
                {
                    "tokens": doc[:prompt_tokens].tolist(),
                    "max_new_tokens": max_new_tokens,
                    "stop_at_eos": False,
                }
            )
        else:
            out.append({"tokens": doc[:max_tokens].tolist()})
    return [p for p in out if len(p["tokens"]) >= 2]


OPENAI_ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def load_prompts(path: str | Path | None = None, chars: int = 256) -> list[str]:
    """Prompts, each cut to `chars` characters: from `path` (.txt: one prompt per blank-line
    separated paragraph; .jsonl: one object per line with a "prompt" or "text" field), else the
    paragraphs of the Debian copyright files under /usr/share/doc (real text, on the machine)."""
    from ..workloads.corpus import copyright_paragraphs, paragraphs

    if chars < 1:
        raise RecipeError(f"--prompt-chars {chars}: must be >= 1")
    if path is None:
        texts = copyright_paragraphs()
        where = "/usr/share/doc/*/copyright"
    else:
        p, where = Path(path), str(path)
        if not p.is_file():
            raise RecipeError(f"--prompts {where}: no such file")
        if p.suffix == ".jsonl":
            texts = []
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    texts.append(obj["prompt"] if "prompt" in obj else obj["text"])
                except (ValueError, KeyError, TypeError):
                    raise RecipeError(
                        f'--prompts {where}:{n}: each line must be a JSON object with a "prompt" or "text" string'
                    ) from None
        else:
            texts = paragraphs(p.read_text(encoding="utf-8"))
    prompts = [t[:chars] for t in texts if isinstance(t, str) and t.strip()]
    if not prompts:
        raise RecipeError(f"--prompts {where}: no prompts found")
    return prompts


def openai_payloads(
    prompts: Sequence[str], endpoint: str, model: str, max_tokens: int, stream: bool = False
) -> list[dict]:
    """OpenAI request bodies, greedy (`temperature: 0`) so every server does the same work;
    streams ask for the final usage chunk (`stream_options.include_usage`)."""
    if endpoint not in OPENAI_ENDPOINTS:
        raise RecipeError(f"endpoint {endpoint!r}: choose from {', '.join(OPENAI_ENDPOINTS)}")
    out = []
    for text in prompts:
        body: dict = {"model": model}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body.update(max_tokens=max_tokens, temperature=0, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out
