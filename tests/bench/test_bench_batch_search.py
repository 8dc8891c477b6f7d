"""bench and optimize on CUDA: the reference's tokens per batch is searched once, before any
contender is built, and every contender adopts it (issue 23). Run on CPU with the search's
CUDA-only gate and its timing replaced (the knee itself is tested in tests/test_batch_size.py)."""

from __future__ import annotations

import pytest

from slipstream import batch_size
from slipstream.bench import run_bench
from slipstream.decisions import Decision
from slipstream.session import Session

SEARCHED = 1024


@pytest.fixture
def searched_on_cpu(monkeypatch):
    """The CUDA gate opened on this CPU and the timing replaced by a fixed knee; counts searches."""
    calls = []

    def searches(cfg, device):
        default = type(cfg).__dataclass_fields__["tokens_per_batch"].default
        return cfg.batch_search == "auto" and cfg.tokens_per_batch == default

    def decide(self, sequences, cfg, *, pad_id, lengths):
        calls.append(len(sequences))
        return Decision("shapes.tokens_per_batch", str(SEARCHED), f"{SEARCHED}: the knee (fed timings)")

    monkeypatch.setattr(batch_size, "searches_batch", searches)
    monkeypatch.setattr(Session, "_decide_tokens_per_batch", decide)
    return calls


def test_bench_searches_once_and_every_contender_adopts_it(searched_on_cpu):
    res = run_bench(
        "gpt-stdlib", ["baseline+shapes.max_len=128", "pad-batch+shapes.max_len=128"], size="tiny",
        rounds=1, warmup_steps=1, val_batches=1, noise_seeds=1, memory="skip",
    )  # fmt: skip
    assert len(searched_on_cpu) == 1 and searched_on_cpu[0] > 1000  # once, on the whole corpus
    assert res.method["batch_search"]["choice"] == str(SEARCHED)
    assert res.method["round_real_tokens"] == 2 * SEARCHED  # the round budget follows the searched size
    # the reference's steps carry at most the searched positions (the default would carry ~8x more)
    assert res.method["real_tokens_per_step"] <= SEARCHED
    for c in res.contenders:
        chosen = {d["field"]: d["choice"] for d in c.info["decisions_list"]}
        assert chosen["shapes.tokens_per_batch"] == str(SEARCHED), c.name


def test_a_pinned_size_is_never_searched(searched_on_cpu):
    res = run_bench(
        "gpt-stdlib", ["baseline+shapes.max_len=128+shapes.tokens_per_batch=512"], size="tiny",
        rounds=1, round_tokens=300, warmup_steps=1, val_batches=1, noise_seeds=0, memory="skip",
    )  # fmt: skip
    assert searched_on_cpu == [] and res.method["batch_search"] is None
