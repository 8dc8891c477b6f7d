import numpy as np
import pytest
import torch
from torch import nn

import slipstream
from slipstream import Recipe, RecipeError, Session
from slipstream.presets import resolve_recipe
from slipstream.recipe import CompileConfig, ShapesConfig
from slipstream.workloads.gpt import build_gpt


def seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, n) for n in lengths]


class NoDocuments(nn.Module):
    def forward(self, input_ids, labels=None):
        return input_ids.float().mean()


def test_presets_select_the_policies():
    assert resolve_recipe("bucket").shapes.mode == "bucket" and resolve_recipe("bucket").shapes.buckets == 8
    assert resolve_recipe("pack").shapes.mode == "pack"
    with pytest.raises(RecipeError, match="shapes.pack_algorithm='best'"):
        resolve_recipe("pack+shapes.pack_algorithm=best")
    with pytest.raises(RecipeError, match="shapes.pack_window=0 is out of range"):
        resolve_recipe("pack+shapes.pack_window=0")


def test_pack_needs_document_ids_and_auto_falls_back():
    data = seqs([5, 9, 12])
    session = Session(Recipe(shapes=ShapesConfig(mode="pack", max_len=16, tokens_per_batch=32)))
    session.prepare_model(NoDocuments())
    with pytest.raises(
        RecipeError, match="shapes.mode=pack refused: NoDocuments.forward takes no document_ids"
    ):
        session.prepare_loader(data)
    session = Session(Recipe(shapes=ShapesConfig(mode="auto", max_len=16, tokens_per_batch=32)))
    session.prepare_model(NoDocuments())
    assert session.prepare_loader(data).policy.name == "bucket"
    assert session.metrics().extra["shape_mode_auto_choice"] == "bucket"


def test_train_with_pack_and_bucket_presets():
    for preset in ("pack", "bucket"):
        result = slipstream.train(
            "gpt-stdlib",
            f"{preset}+shapes.max_len=128+shapes.tokens_per_batch=512",
            2,
            eval_every=0,
            progress=False,
        )
        assert result.metrics.padding_waste < 0.15 and all(np.isfinite(result.loss))
        assert result.metrics.extra["shape_policy"] == preset


@pytest.mark.slow
def test_bucket_under_compile_recompiles_at_most_once_per_extra_bucket():
    torch._dynamo.reset()
    recipe = Recipe(
        shapes=ShapesConfig(mode="bucket", buckets=2, max_len=64, tokens_per_batch=256, multiple_of=8),
        compile=CompileConfig(mode="default"),
    )
    session = Session(recipe)
    model = session.prepare_model(build_gpt("tiny", max_len=64))
    opt = session.build_optimizer(model)
    rng = np.random.default_rng(0)
    loader = session.prepare_loader(seqs(rng.integers(3, 66, 200)))
    for batch in loader:
        loss = model(**batch)
        session.backward(loss)
        session.step(opt)
    m = session.metrics()
    assert m.distinct_shapes == 2
    assert m.recompiles <= 1  # the second bucket compiles at most once, then every step reuses a graph
