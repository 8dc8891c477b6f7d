"""Step shards in one process: every rank's rows together are the step's rows, the weights make the
balanced update equal to the equal split, and the position resumes."""

import numpy as np
import pytest
import torch

from slipstream.distributed.shards import StepShards, split_rows
from slipstream.recipe import Recipe, RecipeError
from slipstream.shapes.loader import ShapedLoader
from slipstream.workloads.gpt import GPT, GPTConfig


def _sequences(n=300, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, size=int(k)).tolist() for k in rng.integers(5, 60, size=n)]


def _shards(rank, world, per_step, shares=None, seed=0):
    cfg = Recipe().override('shapes.mode="bucket"', "shapes.max_len=64", "shapes.tokens_per_batch=256").shapes
    loader = ShapedLoader(_sequences(), cfg, seed=seed, group=per_step)
    shards = StepShards(loader, batches_per_step=per_step, rank=rank, world_size=world)
    if shares is not None:
        shards.set_shares(shares, from_step=0)
    return shards


def _rows(batch):
    return {tuple(r) for r in batch["input_ids"].tolist()}


def test_split_rows_is_proportional_with_a_floor():
    assert split_rows(12, [0.5, 0.5], 1) == [6, 6]
    assert split_rows(12, [2, 1], 1) == [8, 4]
    assert sum(split_rows(13, [0.7, 0.2, 0.1], 2)) == 13
    assert min(split_rows(10, [0.99, 0.01], 2)) == 2  # a slow rank still gets its micro-batches
    with pytest.raises(RecipeError):
        split_rows(3, [1, 1], 2)


@pytest.mark.parametrize("shares", [None, [0.75, 0.25]])
def test_ranks_together_cover_each_step_once_with_weights_summing_to_one(shares):
    world, per_step = 2, 4
    one = _shards(0, 1, per_step).forever()
    ranks = [_shards(r, world, per_step, shares).forever() for r in range(world)]
    for _ in range(5):  # steps
        reference, parts, weight = set(), set(), 0.0
        while True:
            b = next(one)
            reference |= _rows(b)
            if b.step_end:
                break
        shapes = set()
        for it in ranks:
            n = 0
            while True:
                b = next(it)
                n += 1
                parts |= _rows(b)
                weight += b.weight
                shapes.add(b.shape[1])
                if b.step_end:
                    break
            assert n == per_step // world  # same number of micro-batches on every rank
        assert parts == reference and abs(weight - 1.0) < 1e-12
        assert len(shapes) == 1  # lock-step: one row length for all ranks at this step


def test_balanced_split_gives_the_equal_split_gradient():
    """Scaled by their weights, micro-batch gradients summed over ranks are the same whether the
    rows were split 50/50 or 80/20."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_len=64))

    def global_grad(shares):
        model.zero_grad()
        for rank in range(2):
            for b in _take_step(_shards(rank, 2, 4, shares)):
                (model(**b) * b.weight).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    equal, balanced = global_grad(None), global_grad([0.8, 0.2])
    torch.testing.assert_close(balanced, equal, rtol=1e-5, atol=1e-7)


def _take_step(shards):
    out = []
    for b in shards:
        out.append(b)
        if b.step_end:
            return out


def test_position_resumes_and_a_changed_global_batch_is_refused():
    a = _shards(0, 1, 2)
    it = iter(a)
    for _ in range(6):
        next(it)
    state = a.state_dict()
    b = _shards(0, 1, 2)
    b.load_state_dict(state)
    assert _rows(next(iter(b))) == _rows(next(it))
    with pytest.raises(RecipeError, match="batches_per_step=2"):
        _shards(0, 1, 4).load_state_dict(state)
    with pytest.raises(RecipeError, match="multiple of the world size"):
        _shards(0, 2, 3)


class _Recorder:
    def __init__(self):
        self.calls = []

    def set_shares(self, shares, from_step):
        self.calls.append((shares, from_step))


def _balancer(mode="auto"):
    from slipstream.distributed.balance import LoadBalancer
    from slipstream.distributed.env import DistEnv

    shards = _Recorder()
    return LoadBalancer(shards, DistEnv(rank=0, world_size=2), mode, every=10, lead_steps=3), shards


def test_auto_balance_turns_on_for_a_steadily_slower_rank_and_splits_by_speed():
    rng = np.random.default_rng(0)
    balancer, shards = _balancer()
    for window in range(3):
        # per-step seconds per token: the step's own cost (bucket length) times each rank's speed
        base = rng.uniform(1.0, 3.0, size=10)
        by_rank = [list(base * rng.normal(1, 0.02, 10)), list(2 * base * rng.normal(1, 0.02, 10))]
        balancer._decide(by_rank, global_step=10 * (window + 1))
    assert balancer.active  # after the second uneven window, not the first
    assert shards.calls[0][1] == 23 and len(shards.calls) == 2
    fast, slow = shards.calls[-1][0]
    assert abs(fast - 2 / 3) < 0.03 and abs(slow - 1 / 3) < 0.03


def test_auto_balance_stays_off_for_noise_and_one_odd_window():
    rng = np.random.default_rng(1)
    balancer, shards = _balancer()
    for window in range(6):
        base = rng.uniform(1.0, 3.0, size=10)
        slow = 1.5 if window == 2 else 1.0  # one window where rank 1 was held up
        by_rank = [list(base * rng.normal(1, 0.1, 10)), list(slow * base * rng.normal(1, 0.1, 10))]
        balancer._decide(by_rank, global_step=10 * (window + 1))
    assert not balancer.active and shards.calls == []
    assert len(balancer.history) == 6
