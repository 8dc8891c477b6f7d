"""Model adapters: the batch convention of the model the user handed over, and what changes on
its instance (Hugging Face causal LMs: no cache while training, fused kernels)."""

from .convention import (
    CONVENTIONS,
    HF_CAUSAL_LM,
    SHIFTED,
    UNSHIFTED,
    BatchConvention,
    detect_convention,
    is_hf_model,
    loss_of,
    takes_keyword,
    unwrap,
)

__all__ = [
    "CONVENTIONS",
    "HF_CAUSAL_LM",
    "SHIFTED",
    "UNSHIFTED",
    "BatchConvention",
    "detect_convention",
    "is_hf_model",
    "loss_of",
    "takes_keyword",
    "unwrap",
]
