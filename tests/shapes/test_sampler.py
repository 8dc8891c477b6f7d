import numpy as np
import pytest
import torch

from slipstream.recipe import RecipeError, ShapesConfig
from slipstream.shapes import ShapedLoader


def seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, n) for n in lengths]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    return seqs(rng.lognormal(4, 0.9, 600).astype(int).clip(2, 300) + 1)


CFG = ShapesConfig(mode="bucket", max_len=256, tokens_per_batch=1024, buckets=4, multiple_of=8)


def items_of(loader, plans):
    return [seg.item for p in plans for row in p.rows for seg in row]


def test_bucket_batches_respect_budget_and_shapes(data):
    loader = ShapedLoader(data, CFG, seed=0)
    plans = loader.plans()
    edges = loader.policy.buckets.edges
    assert {p.row_len for p in plans} <= set(edges) and len(edges) == 4
    assert len({p.shape for p in plans}) <= 4
    for p in plans:
        B, T = p.shape
        assert B == 1024 // T and B * T <= 1024
        for row in p.rows:
            assert all(len(seg) <= T for seg in row)
    # every item appears exactly once per epoch (tails move up a bucket, none is lost)
    assert sorted(items_of(loader, plans)) == list(range(len(loader.item_seq)))
    # each batch really is padded to its bucket, and real/padded counts add up
    batch = loader.make_batch(plans[0])
    assert tuple(batch["input_ids"].shape) == plans[0].shape
    assert batch.real_tokens == int((batch["labels"] != -100).sum())
    assert batch.real_tokens + batch.padded_tokens == plans[0].shape[0] * plans[0].shape[1]


def test_bucket_waste_close_to_planned(data):
    loader = ShapedLoader(data, CFG, seed=0)
    pad_max = ShapedLoader(data, ShapesConfig(mode="pad_max", max_len=256, tokens_per_batch=1024))
    assert loader.padding_waste() < loader.policy.buckets.expected_waste + 0.05
    assert loader.padding_waste() < pad_max.padding_waste() / 2


def test_deterministic_per_epoch_and_reshuffled(data):
    a, b = ShapedLoader(data, CFG, seed=5), ShapedLoader(data, CFG, seed=5)
    assert a.plans(0) == b.plans(0)
    assert a.plans(0) != a.plans(1)
    assert a.plans(0) != ShapedLoader(data, CFG, seed=6).plans(0)


def test_resume_mid_epoch(data):
    full = [b["input_ids"] for b in ShapedLoader(data, CFG, seed=3)]
    first = ShapedLoader(data, CFG, seed=3)
    it = iter(first)
    head = [next(it)["input_ids"] for _ in range(5)]
    second = ShapedLoader(data, CFG, seed=3)
    second.load_state_dict(first.state_dict())
    tail = [b["input_ids"] for b in second]
    assert len(head + tail) == len(full)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, full))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_shards_with_the_same_shape_schedule(data, world_size):
    loaders = [ShapedLoader(data, CFG, seed=0, rank=r, world_size=world_size) for r in range(world_size)]
    plans = [ld.plans() for ld in loaders]
    assert len({len(p) for p in plans}) == 1
    for step in zip(*plans):
        assert len({p.shape for p in step}) == 1  # same shape on every rank at every step
    shards = [set(items_of(ld, p)) for ld, p in zip(loaders, plans)]
    for i in range(world_size):
        for j in range(i + 1, world_size):
            assert not shards[i] & shards[j]
    # only the longest bucket's incomplete group may be left out
    covered = sum(len(s) for s in shards)
    assert covered >= len(loaders[0].item_seq) - (world_size - 1) * max(loaders[0].policy.rows)


def test_bad_input(data):
    with pytest.raises(RecipeError, match="tokens_per_batch=100 is smaller than one row of 256"):
        ShapedLoader(data, ShapesConfig(mode="bucket", max_len=256, tokens_per_batch=100))
    # k larger than the distinct lengths: one bucket per distinct length, no error
    loader = ShapedLoader(
        seqs([5, 5, 9, 9]),
        ShapesConfig(mode="bucket", max_len=16, tokens_per_batch=16, buckets=50, multiple_of=1),
    )
    assert loader.policy.buckets.edges == (4, 8) and loader.padding_waste() == 0.25
    with pytest.raises(RecipeError, match="empty"):
        ShapedLoader([], ShapesConfig(mode="bucket"))
    with pytest.raises(RecipeError, match="fewer than 2 tokens"):
        ShapedLoader([[], [3]], ShapesConfig(mode="bucket"))
