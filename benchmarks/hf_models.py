"""Hugging Face models for the issue-13 benchmarks, built from a config (nothing is downloaded).

    slipstream bench --model benchmarks.hf_models:gpt2_small --data ... --tokenizer ...

VOCAB matches the tokenizer benchmarks/hf_corpus.py trains (8,192 BPE tokens).
"""

from __future__ import annotations

VOCAB = 8192


def gpt2_small():
    """GPT-2, 4 layers, d=256 (the issue's measurement), dropout off so runs are comparable."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=1024, n_embd=256, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def llama_small():
    """Llama-style (RMSNorm, SwiGLU, rotary, grouped-query attention), 4 layers, d=256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def llama_mid():
    """Llama-style, 12 layers, d=768, GQA 12/4 heads: ~88M parameters (the first H200 run's user
    model: shared/gpu/h200-2026-12-04)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)
