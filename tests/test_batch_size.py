"""GPU-sized batches: the doubling search's rules, fed measurements (no GPU needed)."""

from __future__ import annotations

import pytest

from slipstream import Recipe, Session, ShapesConfig
from slipstream.batch_size import KNEE_GAIN, OutOfMemory, find_knee


def curve(rates: dict[int, float], peaks: dict[int, int] | None = None, oom_at: int | None = None):
    seen = []

    def measure(tokens: int):
        seen.append(tokens)
        if oom_at is not None and tokens >= oom_at:
            raise OutOfMemory(f"{tokens}")
        return rates[tokens], (peaks or {}).get(tokens)

    return measure, seen


def test_the_knee_is_the_last_doubling_that_paid():
    # launch-bound at small batches: throughput nearly doubles, then flattens past 65,536 tokens
    rates = {8192: 20e3, 16384: 39e3, 32768: 70e3, 65536: 110e3, 131072: 115e3, 262144: 116e3}
    measure, seen = curve(rates)
    choice = find_knee(measure, 8192)
    assert choice.tokens == 65536
    assert seen == [8192, 16384, 32768, 65536, 131072]  # stops at the first doubling under the knee
    assert "knee" in choice.reason and "131072: 115,000 tok/s" in choice.reason


def test_a_gain_just_under_the_threshold_stops_the_search():
    measure, _ = curve({8192: 100.0, 16384: 100.0 * KNEE_GAIN * 0.999})
    assert find_knee(measure, 8192).tokens == 8192
    measure, _ = curve({8192: 100.0, 16384: 100.0 * KNEE_GAIN * 1.001, 32768: 100.0})
    assert find_knee(measure, 8192).tokens == 16384


def test_memory_headroom_and_out_of_memory_keep_the_smaller_size():
    gib = 2**30
    rates = {8192: 1.0, 16384: 2.0, 32768: 4.0, 65536: 8.0}
    measure, _ = curve(rates, peaks={8192: 10 * gib, 16384: 20 * gib, 32768: 90 * gib, 65536: 1})
    choice = find_knee(measure, 8192, memory_bytes=100 * gib)
    assert choice.tokens == 16384 and "85%" in choice.reason
    measure, _ = curve(rates, oom_at=32768)
    choice = find_knee(measure, 8192)
    assert choice.tokens == 16384 and "out of memory" in choice.reason


def test_the_search_stops_at_its_limit_and_other_errors_propagate():
    measure, seen = curve({8192: 1.0, 16384: 2.0, 32768: 4.0})
    assert find_knee(measure, 8192, max_tokens=32768).tokens == 32768 and seen[-1] == 32768

    def broken(tokens):
        raise ValueError("the model's forward failed")

    with pytest.raises(ValueError, match="forward failed"):
        find_knee(broken, 8192)


def test_cpu_sessions_never_search():
    session = Session(Recipe(shapes=ShapesConfig(mode="bucket", max_len=32)))
    assert not session._searches_batch(session.recipe.shapes)
    seqs = [list(range(1, 20))] * 40
    session.prepare_loader(seqs)
    assert "shapes.tokens_per_batch" not in session.decisions


def test_a_pinned_or_switched_off_budget_is_never_searched():
    import torch

    session = Session(Recipe())
    session.device = torch.device("cuda")  # only the rule is checked: nothing runs on the device
    session.local_model = torch.nn.Linear(1, 1)
    assert session._searches_batch(ShapesConfig())
    assert not session._searches_batch(ShapesConfig(tokens_per_batch=16384))
    assert not session._searches_batch(ShapesConfig(batch_search="off"))
