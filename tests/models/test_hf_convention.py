"""Hugging Face causal LMs get exactly the batches transformers expects, packed rows stay exact."""

import numpy as np
import pytest
import torch
from torch import nn

from slipstream import Recipe, RecipeError, Session, ShapesConfig
from slipstream.models import HF_CAUSAL_LM, SHIFTED, detect_convention, loss_of
from slipstream.models.verify import packing_problem
from slipstream.shapes.loader import ShapedLoader

from .conftest import BUILDERS, documents, transformers


def recipe(mode: str, **shapes) -> Recipe:
    cfg = {"mode": mode, "max_len": 128, "tokens_per_batch": 512, **shapes}
    return Recipe(shapes=ShapesConfig(**cfg), optimizer=Recipe().optimizer)


def plain_hf_batch(batch) -> dict[str, torch.Tensor]:
    """What a Hugging Face user builds from the same documents: right padding, attention_mask, -100
    (in the same [B, T] shape: another width changes fp32 rounding by ~1e-6, not the function)."""
    rows = []
    for r in range(batch["input_ids"].shape[0]):
        real = batch["labels"][r] != -100
        if not real.any():
            continue
        n = int(real.nonzero().max()) + 1
        rows.append(batch["input_ids"][r, :n])
    T = batch["input_ids"].shape[1]
    ids = torch.full((len(rows), T), 258)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for r, x in enumerate(rows):
        ids[r, : len(x)], mask[r, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_detects_the_convention():
    from slipstream.workloads.gpt import build_gpt

    assert detect_convention(BUILDERS["gpt2"]())[0] is HF_CAUSAL_LM
    assert detect_convention(BUILDERS["llama"]())[0] is HF_CAUSAL_LM
    assert detect_convention(build_gpt("tiny"))[0] is SHIFTED
    convention, why = detect_convention(nn.Linear(2, 2))
    assert convention is SHIFTED and "slipstream_convention" in why
    assert detect_convention(nn.Linear(2, 2), "unshifted")[0].labels_shifted is False


def test_refuses_hf_models_that_are_not_causal_lms():
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    with pytest.raises(RecipeError, match="BertForMaskedLM is not a causal LM.*AutoModelForCausalLM"):
        Session("baseline").prepare_model(bert)
    with pytest.raises(RecipeError, match="unknown batch convention 'sideways'"):
        detect_convention(nn.Linear(2, 2), "sideways")


@pytest.mark.parametrize("mode", ["pad_batch", "bucket", "pack"])
def test_labels_are_unshifted_with_minus_100_at_padding_and_document_starts(mode):
    session = Session(recipe(mode))
    session.prepare_model(BUILDERS["llama"]())
    loader = session.prepare_loader(documents(), pad_id=258)
    batch = next(iter(loader))
    ids, labels = batch["input_ids"], batch["labels"]
    kept = labels != -100
    assert torch.equal(labels[kept], ids[kept])  # not shifted: the model shifts them itself
    assert "document_ids" not in batch and "attention_mask" not in batch  # nothing the model would drop
    # every predicted position is counted, first tokens of documents are not
    assert batch.real_tokens == int(kept[:, 1:].sum())
    if mode == "pack":
        pos = batch["position_ids"]
        starts = (pos == 0) & (ids != 258)
        assert not kept[starts].any()  # no prediction across a document boundary
        assert (pos[:, 1:] == 0).any()  # several documents in a row
    else:
        assert "position_ids" not in batch


def test_split_overflow_keeps_every_prediction_for_unshifted_labels():
    doc = np.arange(2, 52)  # 50 tokens, 49 predictions
    cfg = ShapesConfig(mode="pad_max", max_len=16, tokens_per_batch=64, overflow="split")
    loader = ShapedLoader([doc], cfg, convention=HF_CAUSAL_LM)
    predicted = []
    for batch in loader:
        for r in range(batch["input_ids"].shape[0]):
            ids, lab = batch["input_ids"][r], batch["labels"][r]
            predicted += [int(lab[t]) for t in range(1, 16) if lab[t] != -100]
            assert all(lab[t] in (-100, ids[t]) for t in range(16))
    assert sorted(predicted) == list(range(3, 52))  # each token after the first predicted exactly once


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_first_step_loss_equals_a_plain_hf_loop(kind):
    docs = documents()
    session = Session(recipe("bucket"))
    model = session.prepare_model(BUILDERS[kind]())
    batch = next(iter(session.prepare_loader(docs, pad_id=258)))
    ours = float(loss_of(model(**batch)))
    plain = BUILDERS[kind]()  # same seed, same weights, the class's own forward
    theirs = float(plain(**plain_hf_batch(batch)).loss)
    assert abs(ours - theirs) <= 1e-6


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_thirty_steps_follow_the_plain_loop(kind):
    """Same batches, same init: Session's loop and a plain HF loop stay together step by step."""
    docs = documents(n=120)
    session = Session(recipe("pad_batch", tokens_per_batch=256))
    model = session.prepare_model(BUILDERS[kind]())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plain = BUILDERS[kind]()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    ours, theirs = [], []
    for _, batch in zip(range(30), session.prepare_loader(docs, pad_id=258).forever()):
        loss = loss_of(model(**batch))
        loss.backward()
        opt.step(), opt.zero_grad()
        out = plain(**plain_hf_batch(batch))
        out.loss.backward()
        plain_opt.step(), plain_opt.zero_grad()
        ours.append(float(loss)), theirs.append(float(out.loss))
    assert ours[-1] < ours[0] - 0.5  # it learns
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_packed_document_loss_equals_alone(kind):
    model = BUILDERS[kind]()
    session = Session(recipe("pack"))
    session.prepare_model(model)
    assert session.packing_problem(documents()) is None
    # and the measured gap, not only the verdict, is within 1e-5
    from slipstream.models import verify

    old = verify.PACKING_TOLERANCE
    verify.PACKING_TOLERANCE = 1e-5
    try:
        assert packing_problem(model, HF_CAUSAL_LM, torch.device("cpu"), documents(seed=3)) is None
    finally:
        verify.PACKING_TOLERANCE = old


class IgnoresPositions(transformers.LlamaForCausalLM):
    """A model that drops position_ids (as linear-attention models do): packing would be wrong."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


def test_a_model_that_ignores_packed_positions_is_refused():
    model = IgnoresPositions(BUILDERS["llama"]().config)
    session = Session(recipe("pack"))
    session.prepare_model(model)
    with pytest.raises(RecipeError, match="pack refused: IgnoresPositions.*ignores the packed position_ids"):
        session.prepare_loader(documents(), pad_id=258)
    auto = Session(recipe("auto"))
    auto.prepare_model(IgnoresPositions(BUILDERS["llama"]().config))
    assert auto.prepare_loader(documents(), pad_id=258).policy.name == "bucket"
    assert "packing refused" in auto.decisions["shapes.mode"]["reason"]


def test_training_forward_has_no_cache_but_generation_still_works():
    model = Session("baseline").prepare_model(BUILDERS["llama"]())
    ids = torch.tensor([[256, 5, 6, 7]])
    assert model(input_ids=ids, labels=ids).past_key_values is None
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=258)
    assert out.shape == (1, 7)
