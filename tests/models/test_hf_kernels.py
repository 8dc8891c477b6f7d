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


def test_auto_times_only_the_ops_this_model_has_and_swaps_the_winners():
    from slipstream.kernels import KernelChooser, injected_timer
    from slipstream.models.hf import apply_hf_kernels

    seen = []
    table = {
        "linear_cross_entropy": {"keep": 2.0, "torch": 1.0},  # the chunked head wins
        "rms_norm": {"keep": 1.0},
        "swiglu": {"keep": 1.0},
    }

    def timer(op, candidate, run, device):
        seen.append(op)
        return injected_timer(table)(op, candidate, run, device)

    model = BUILDERS["llama"]()
    report = apply_hf_kernels(model, "auto", torch.device("cpu"), chooser=KernelChooser(rows=64, timer=timer))
    assert set(seen) == {"linear_cross_entropy", "rms_norm", "swiglu"}  # a Llama has no LayerNorm
    assert report.backends == {"linear_cross_entropy": "torch"}
    assert report.swapped == {"linear_cross_entropy": 1}
    assert "kept the model's own module" in report.skipped["rms_norm"]
    assert report.skipped["layer_norm"] == "not in this model"


def test_auto_in_a_session_records_each_ops_timing():
    session = kernels_session("auto")
    session.prepare_model(BUILDERS["llama"]())
    decisions = session.decisions
    assert {"kernels.linear_cross_entropy", "kernels.rms_norm", "kernels.swiglu"} <= set(decisions)
    assert "fwd+bwd at 512x" in decisions["kernels.linear_cross_entropy"]["reason"]
    assert decisions["kernels.rms_norm"]["choice"] == "keep"  # on CPU nothing but torch's op is timed


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
