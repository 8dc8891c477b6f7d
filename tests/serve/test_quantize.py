import copy

import numpy as np
import pytest
import torch

from slipstream.recipe import RecipeError
from slipstream.serve.quantize import QUANT_MODES, quantize_model, validation_loss


@pytest.mark.parametrize("mode", ["bf16", "int8-weight-only", "int8-dynamic"])
def test_quantized_model_stays_close_and_the_loss_delta_is_measured(tiny, mode):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n) for n in rng.integers(2, 64, 12)]
    q = quantize_model(copy.deepcopy(tiny.model), mode)
    if mode.startswith("int8"):
        assert type(q.blocks[0].attn.qkv.weight).__name__ != "Parameter"  # a torchao int8 tensor
        assert q.lm_head.weight is q.wte.weight  # the tied head stays full precision
    base, quant = validation_loss(tiny, docs, 64), validation_loss(tiny, docs, 64, runner=q)
    assert quant != base and abs(quant - base) < 0.05
    x = torch.randint(0, 256, (2, 16))
    with torch.inference_mode():
        assert torch.isfinite(q(x).float()).all()


def test_unknown_mode_is_refused_naming_the_choices(tiny):
    with pytest.raises(RecipeError, match="int8-dynamic"):
        quantize_model(tiny.model, "int4")
    assert "none" in QUANT_MODES and quantize_model(tiny.model, "none") is tiny.model
