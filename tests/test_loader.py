import numpy as np
import pytest
import torch

from slipstream import RecipeError, Session
from slipstream.recipe import Recipe, ShapesConfig
from slipstream.shapes import ShapedLoader


def seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, n) for n in lengths]


def test_pad_max_shapes_labels_and_counts():
    data = seqs([5, 9, 3, 12, 7])
    loader = ShapedLoader(data, ShapesConfig(mode="pad_max", max_len=16, tokens_per_batch=32), pad_id=258)
    batches = list(loader)
    assert all(tuple(b["input_ids"].shape) == (2, 16) for b in batches)
    assert len(batches) == 3  # 5 items, 2 per batch, last batch padded with an empty row
    assert sum(b.real_tokens for b in batches) == sum(n - 1 for n in [5, 9, 3, 12, 7])
    for b in batches:
        real = (b["labels"] != -100).sum().item()
        assert real == b.real_tokens and b.padded_tokens == 32 - real
        # labels are the next token of the same sequence
        for row_in, row_lab in zip(b["input_ids"], b["labels"]):
            n = int((row_lab != -100).sum())
            if n:
                assert torch.equal(row_in[1:n], row_lab[: n - 1])


def test_pad_batch_pads_to_longest_in_batch():
    loader = ShapedLoader(
        seqs([5, 9, 3, 12]), ShapesConfig(mode="pad_batch", max_len=16, tokens_per_batch=32)
    )
    for b in loader:
        assert b["input_ids"].shape[1] == int((b["labels"] != -100).sum(1).max())


def test_overflow_policies():
    data = seqs([40, 5])
    with pytest.raises(RecipeError, match="longer than shapes.max_len=16.*overflow=truncate or split"):
        ShapedLoader(data, ShapesConfig(max_len=16, overflow="error", tokens_per_batch=32))
    t = ShapedLoader(data, ShapesConfig(max_len=16, overflow="truncate", tokens_per_batch=32))
    assert t.overflow.overflowed == 1 and t.overflow.dropped_tokens == 39 - 16
    s = ShapedLoader(data, ShapesConfig(max_len=16, overflow="split", tokens_per_batch=32))
    assert s.overflow.items == 4 and s.overflow.dropped_tokens == 0  # 39 positions -> 16 + 16 + 7
    assert sum(b.real_tokens for b in s) == 39 + 4


def test_bad_input_errors():
    with pytest.raises(RecipeError, match="empty"):
        ShapedLoader([], ShapesConfig())
    with pytest.raises(RecipeError, match="fewer than 2 tokens"):
        ShapedLoader([[1], []], ShapesConfig())
    with pytest.raises(RecipeError, match="must be integers"):
        ShapedLoader([np.array([0.5, 1.5])], ShapesConfig())
    with pytest.raises(RecipeError, match="tokens_per_batch=8 is smaller than one row of 16"):
        ShapedLoader(seqs([5]), ShapesConfig(max_len=16, tokens_per_batch=8))


def test_resume_mid_epoch_gives_the_same_batches():
    data = seqs(range(3, 40))
    cfg = ShapesConfig(mode="pad_max", max_len=48, tokens_per_batch=96)
    full = [b["input_ids"] for b in ShapedLoader(data, cfg, seed=3)]
    first = ShapedLoader(data, cfg, seed=3)
    it = iter(first)
    head = [next(it)["input_ids"] for _ in range(4)]
    state = first.state_dict()
    second = ShapedLoader(data, cfg, seed=3)
    second.load_state_dict(state)
    tail = [b["input_ids"] for b in second]
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full, strict=True))
    other = ShapedLoader(data, cfg, seed=4)
    with pytest.raises(RecipeError, match="does not match"):
        other.load_state_dict(state)


def test_epochs_reshuffle_deterministically():
    data = seqs(range(3, 40))
    cfg = ShapesConfig(max_len=48, tokens_per_batch=96)
    a = ShapedLoader(data, cfg, seed=1)
    e0 = [b["input_ids"] for b in a]
    e1 = [b["input_ids"] for b in a]
    assert not all(torch.equal(x, y) for x, y in zip(e0, e1))
    b = ShapedLoader(data, cfg, seed=1)
    assert all(torch.equal(x, y["input_ids"]) for x, y in zip(e0, b))


def test_ranks_get_disjoint_shards():
    data = seqs(range(3, 43))
    cfg = ShapesConfig(max_len=48, tokens_per_batch=96)
    seen = []
    for rank in range(2):
        loader = ShapedLoader(data, cfg, seed=0, rank=rank, world_size=2)
        for plan in loader.plans():
            seen += [seg.item for row in plan.rows for seg in row]
    assert len(seen) == len(set(seen))


def test_session_loop_counts_real_tokens():
    session = Session(Recipe(shapes=ShapesConfig(max_len=32, tokens_per_batch=64)))
    model = torch.nn.Embedding(256, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = session.prepare_loader(seqs([5, 9, 3, 12, 30]))
    for batch in loader:
        loss = model(batch["input_ids"]).mean()
        session.backward(loss)
        session.step(opt)
    m = session.metrics()
    assert m.steps == 3 and m.real_tokens == 4 + 8 + 2 + 11 + 29
    assert m.real_tokens + m.padded_tokens == 3 * 64
    assert m.distinct_shapes == 1 and m.peak_memory_bytes > 0


def test_pack_refused_for_a_model_without_document_ids():
    session = Session(Recipe(shapes=ShapesConfig(mode="pack", max_len=32, tokens_per_batch=64)))
    session.prepare_model(torch.nn.Linear(2, 2))
    with pytest.raises(RecipeError, match="shapes.mode=pack refused: Linear.forward takes no document_ids"):
        session.prepare_loader(seqs([5, 9]))


def test_peak_memory_is_this_process_not_an_inherited_high_water_mark():
    import subprocess
    import sys

    code = (
        "import torch; from slipstream.metrics import peak_memory;print(peak_memory(torch.device('cpu'))[0])"
    )
    # A parent that touched 1.5 GiB: Linux carries ru_maxrss across exec, VmHWM does not.
    parent = (
        "import subprocess, sys; n = 1536 * 2**20; b = bytearray(n); b[::4096] = bytes(len(range(0, n, 4096)));"
        "b[::4096] = b'1' * len(range(0, n, 4096));"
        f"print(subprocess.check_output([sys.executable, '-c', {code!r}]).decode())"
    )
    child_peak = int(subprocess.check_output([sys.executable, "-c", parent]).decode().strip())
    assert child_peak < 1024 * 2**20


# ----------------------------------------------------------------------------- issue 25 leftovers


def test_token_ids_an_embedding_cannot_look_up_are_refused_before_the_model_sees_them():
    from slipstream.workloads.gpt import build_gpt

    with pytest.raises(
        RecipeError, match=r"sequence 1 holds token id -5 at position 2; token ids must be >= 0"
    ):
        ShapedLoader([[1, 2, 3], [4, 5, -5, 6]], ShapesConfig(max_len=16, tokens_per_batch=32))
    with pytest.raises(RecipeError, match=r"pad_id=-1 must be a token id"):
        ShapedLoader(seqs([5]), ShapesConfig(max_len=16, tokens_per_batch=32), pad_id=-1)
    session = Session(Recipe(shapes=ShapesConfig(max_len=16, tokens_per_batch=32)))
    session.prepare_model(build_gpt("tiny", max_len=16))  # vocabulary: 264 ids
    with pytest.raises(RecipeError, match=r"sequence 0 holds token id 300 .* in \[0, 264\)"):
        session.prepare_loader([[1, 2, 300, 4], [5, 6, 7]])
    # with lengths given nothing is scanned up front: the batch holding the id is refused, by name
    bad = [[1, 2, 3], [4, 5, 6, -7]]
    loader = session.prepare_loader(bad, lengths=np.array([3, 4]))
    with pytest.raises(RecipeError, match=r"sequence 1 holds token id -7 at position 3"):
        list(loader)


def test_pack_is_checked_in_rows_no_wider_than_max_len():
    # The packing check used to lay its probe documents in one 65-68 column row, so at
    # shapes.max_len=64 a GPT with 64 positions "failed on a packed batch" and pack was refused.
    from slipstream.workloads.gpt import build_gpt

    torch.manual_seed(0)
    for max_len in (64, 16, 4):
        session = Session(
            Recipe(shapes=ShapesConfig(mode="pack", max_len=max_len, tokens_per_batch=4 * max_len))
        )
        model = session.prepare_model(build_gpt("tiny", max_len=max_len))
        loader = session.prepare_loader(seqs([100, 40, 70, 9, 120]))
        assert session.packing_problem() is None
        batch = next(iter(loader))
        assert batch["input_ids"].shape[1] == max_len and torch.isfinite(model(**batch))
