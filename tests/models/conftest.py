import numpy as np
import pytest

transformers = pytest.importorskip("transformers")


def tiny_gpt2(vocab: int = 264, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256, eos_token_id=257,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama(vocab: int = 264, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def documents(n: int = 60, seed: int = 0, low: int = 4, high: int = 90) -> list[np.ndarray]:
    """Byte documents framed by BOS (256) and EOS (257), of random lengths; each counts up by a
    step of 1-3 from a random start, so a model can learn them in a few steps."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        k = np.arange(int(rng.integers(low, high)))
        body = (int(rng.integers(0, 256)) + int(rng.integers(1, 4)) * k) % 256
        docs.append(np.concatenate([[256], body, [257]]).astype(np.int64))
    return docs


@pytest.fixture(params=sorted(BUILDERS))
def hf_kind(request):
    return request.param
