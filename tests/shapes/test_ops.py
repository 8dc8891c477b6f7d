import pytest
import torch
import torch.nn.functional as F

from slipstream.shapes import (
    count_tokens,
    masked_mean,
    masked_sum,
    segment_sum,
    token_weights,
    weighted_select,
)
from slipstream.workloads.gpt import build_gpt


def test_masked_sum_and_mean_match_indexing():
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    mask = torch.rand(4, 7) > 0.5
    torch.testing.assert_close(masked_sum(x, mask), x[mask].sum())
    torch.testing.assert_close(masked_mean(x, mask), x[mask].mean())
    torch.testing.assert_close(
        masked_mean(x, mask, dim=1)[mask.any(1)],
        torch.stack([r[m].mean() for r, m in zip(x, mask) if m.any()]),
    )


def test_masked_mean_of_nothing_is_zero_and_ignores_inf():
    x = torch.tensor([1.0, float("inf"), float("nan")])
    assert masked_mean(x, torch.zeros(3, dtype=torch.bool)) == 0
    assert masked_mean(x, torch.tensor([True, False, False])) == 1.0


def test_weighted_select_is_a_static_shape_x_mask():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, requires_grad=True)
    mask = torch.rand(3, 5) > 0.4
    out, valid = weighted_select(x, mask, capacity=15)
    n = int(mask.sum())
    assert out.shape == (15, 4) and valid.sum() == n
    torch.testing.assert_close(out[:n], x[mask])
    assert (out[n:] == 0).all()
    out.sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].float().expand_as(x))
    small, valid = weighted_select(x.detach(), mask, capacity=2)  # overflow rows are dropped, not an error
    torch.testing.assert_close(small, x.detach()[mask][:2])
    assert valid.all()


def test_segment_sum_count_and_weights():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(segment_sum(v, torch.tensor([0, 2, 0, 2]), 3), torch.tensor([4.0, 0.0, 6.0]))
    labels = torch.tensor([[3, -100, 5], [-100, -100, 1]])
    assert count_tokens(labels).item() == 3 and count_tokens(labels).dim() == 0
    assert token_weights(labels).tolist() == [[1, 0, 1], [0, 0, 1]]


def test_gpt_mean_loss_is_mask_free_and_safe_on_all_padding():
    torch.manual_seed(0)
    model = build_gpt("tiny", max_len=32)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    y[0, 5:] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(model(x, labels=y), expected)
    empty = model(x, labels=torch.full_like(y, -100))
    assert empty.item() == 0.0  # F.cross_entropy would give nan here
    empty.backward()  # and gradients stay finite
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa_mask_forward():
    pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention needs torch >= 2.5")
    torch.manual_seed(0)
    sdpa = build_gpt("tiny", max_len=64).eval()
    flex = build_gpt("tiny", max_len=64, attention="flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 256, (2, 32))
    doc = torch.tensor([[0] * 10 + [1] * 22, [0] * 31 + [1]])
    pos = torch.cat([torch.arange(10), torch.arange(22)]).expand(2, 32).clone()
    pos[1] = torch.cat([torch.arange(31), torch.arange(1)])
    with torch.no_grad():  # forward only: FlexAttention has no CPU backward in torch 2.13
        torch.testing.assert_close(
            flex(x, position_ids=pos, document_ids=doc), sdpa(x, position_ids=pos, document_ids=doc)
        )
