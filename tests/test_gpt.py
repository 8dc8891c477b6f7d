import pytest
import torch
import torch.nn.functional as F

from slipstream.workloads.gpt import build_gpt


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_gpt("tiny", max_len=64)


def test_loss_matches_manual_cross_entropy(model):
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    y[1, 10:] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(model(x, labels=y), expected)


def test_is_causal(model):
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10:] = 7
    torch.testing.assert_close(model(x)[:, :10], model(x2)[:, :10])


def test_document_ids_isolate_documents(model):
    a = torch.randint(0, 256, (1, 6))
    b = torch.randint(0, 256, (1, 10))
    packed = torch.cat([a, b], dim=1)
    doc = torch.tensor([[0] * 6 + [1] * 10])
    pos = torch.cat([torch.arange(6), torch.arange(10)])[None]
    out = model(packed, position_ids=pos, document_ids=doc)
    torch.testing.assert_close(out[:, 6:], model(b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :6], model(a), atol=1e-5, rtol=1e-5)


def test_rejects_sequences_longer_than_positions(model):
    with pytest.raises(ValueError, match="exceeds the model's max_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_unknown_size():
    with pytest.raises(ValueError, match="choose one of tiny, small, gpt2-124m"):
        build_gpt("huge")


@pytest.mark.parametrize("kw", [{"mlp": "swiglu"}, {"norm": "rmsnorm"}])
def test_variants_train(kw):
    torch.manual_seed(0)
    m = build_gpt("tiny", max_len=32, **kw)
    x = torch.randint(0, 256, (2, 32))
    loss = m(x, labels=x)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters())
