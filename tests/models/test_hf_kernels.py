"""Fused kernels on Hugging Face instances: the same loss and gradients as the model's own forward."""

import pytest
import torch

from slipstream import KernelsConfig, Recipe, Session, ShapesConfig
from slipstream.models import loss_of

from .conftest import BUILDERS, documents, transformers

ALL_HF_OPS = ("linear_cross_entropy", "rms_norm", "swiglu", "layer_norm")


def kernels_session(ops) -> Session:
    return Session(
        Recipe(
            kernels=KernelsConfig(ops=ops),
            shapes=ShapesConfig(mode="bucket", max_len=128, tokens_per_batch=512),
        )
    )


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_fused_kernels_give_the_models_own_loss_and_gradients(kind):
    session = kernels_session(ALL_HF_OPS)
    fused = session.prepare_model(BUILDERS[kind]())
    swapped = session.metrics().extra["kernels_swapped"]
    assert swapped["linear_cross_entropy"] == 1
    if kind == "llama":
        assert swapped["rms_norm"] == 5 and swapped["swiglu"] == 2  # 2 layers x 2 norms + final; 2 MLPs
    else:
        assert swapped["layer_norm"] == 5
    batch = next(iter(session.prepare_loader(documents(), pad_id=258)))
    plain = BUILDERS[kind]()
    out = fused(**batch)
    assert out.logits is None  # the [tokens, vocab] logits were never built
    loss, ref = loss_of(out), plain(**batch).loss
    assert abs(float(loss) - float(ref)) <= 1e-5
    loss.backward(), ref.backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_auto_on_cpu_fuses_only_the_lm_head():
    session = kernels_session("auto")
    session.prepare_model(BUILDERS["llama"]())
    extra = session.metrics().extra
    assert extra["kernels_swapped"] == {"linear_cross_entropy": 1}
    assert "no gain on the torch backend" in extra["kernels_skipped"]["rms_norm"]


class ScaledLogits(transformers.GPT2LMHeadModel):
    """A head that does more than a linear layer (as soft-capped heads do)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        logits = out.logits * 0.5
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_fused_head_is_refused_where_it_would_change_the_loss():
    session = kernels_session(("linear_cross_entropy",))
    model = session.prepare_model(ScaledLogits(BUILDERS["gpt2"]().config))
    extra = session.metrics().extra
    assert "linear_cross_entropy" not in extra["kernels_swapped"]
    assert "differs from the model's own" in extra["kernels_skipped"]["linear_cross_entropy"]
    ids = torch.tensor([[256, 3, 4, 5]])
    assert model(input_ids=ids, labels=ids).logits is not None  # its own forward still runs
