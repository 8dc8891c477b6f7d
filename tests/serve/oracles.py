"""Test oracles: the slow, obviously correct computations the engines are checked against, and
the driver that scores through an engine the way a server does."""

from __future__ import annotations

import asyncio

import torch

from slipstream.serve.engine import _score_result
from slipstream.serve.model import LoadedModel


def generate_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running model(input_ids) on the whole prefix each step."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.as_tensor([ids], device=next(model.parameters()).device))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def score_reference(loaded: LoadedModel, tokens: list[int]) -> dict:
    """One sequence alone, unpadded, through model(input_ids) -> logits."""
    x = torch.as_tensor([tokens], dtype=torch.long, device=next(loaded.model.parameters()).device)
    with torch.inference_mode():
        out = loaded.model(x) if loaded.family == "gpt" else loaded.model(input_ids=x).logits
    logp = torch.log_softmax(out.float()[0, :-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]
    return _score_result((-logp).cpu().numpy(), True)


def score_all(engine, seqs: list[list[int]], warmup: bool = True) -> list[dict]:
    """Start `engine` (with its warm-up unless it was done already), score every sequence
    concurrently (token log-probs included), drain it, and return the answers in order."""

    async def run():
        await engine.start(warmup=warmup)
        try:
            return await asyncio.gather(*[engine.score(s, token_logprobs=True) for s in seqs])
        finally:
            await engine.drain(5)

    return asyncio.run(run())
