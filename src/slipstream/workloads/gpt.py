"""A decoder-only GPT in the nanoGPT / gpt-fast mould, built to take packed batches.

`forward(input_ids, labels=None, position_ids=None, document_ids=None)`:
- labels are already shifted (labels[t] is the token after input_ids[t]); -100 is ignored,
- position_ids restart per document when rows are packed,
- document_ids [B, T] restrict attention to tokens of the same document (block-diagonal causal).
The loss goes through `self.loss_head` so fused kernels can replace it on the instance.

Document masking per device (GPTConfig.attention="auto"): FlexAttention with a block mask on CUDA
(skips whole blocks of other documents), SDPA with a [B, 1, T, T] bool mask elsewhere, because
FlexAttention's backward is not implemented on CPU in torch 2.13. Without document_ids attention
is plain causal SDPA (is_causal=True), which padding at the end of a row never disturbs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..shapes.ops import count_tokens

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 264
    """Number of token ids (the byte corpus uses 264)."""
    max_len: int = 1024
    """Positions the model can embed."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads (d_model must divide evenly)."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """MLP kind: GPT-2 GELU(tanh) or gated SwiGLU."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalisation layer."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs deterministic and comparable)."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """Document-masked attention for packed rows: SDPA with a bool mask, FlexAttention with a block
    mask, or auto (flex on CUDA, sdpa elsewhere: flex has no CPU backward in torch 2.13)."""


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=64, n_layers=2, n_heads=2),
    "small": GPTConfig(d_model=256, n_layers=4, n_heads=4),
    "gpt2-124m": GPTConfig(d_model=768, n_layers=12, n_heads=12),
}


def document_attention_backend(choice: str, device: torch.device) -> str:
    """Which document-masked attention runs on `device` for GPTConfig.attention=`choice`."""
    if choice == "auto":
        return "flex" if device.type == "cuda" and _flex_available() else "sdpa"
    if choice == "flex" and not _flex_available():
        raise RuntimeError("attention='flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    return choice


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_compiled_flex = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: object) -> Tensor:
    """FlexAttention is only fast compiled; on CUDA compile it once per process, lazily (no
    import-time work). Elsewhere run it eager: the reference path, forward-only on CPU in torch 2.13."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=block_mask)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask)


def document_block_mask(document_ids: Tensor) -> object:
    """FlexAttention BlockMask: causal and within one document (blocks of other documents skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)


class LMHeadLoss(nn.Module):
    """Final projection + cross-entropy; a fused kernel can replace this module on the instance."""

    slipstream_kernel = "linear_cross_entropy"

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        logits = hidden @ weight.t()
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction=reduction)


class SwiGLU(nn.Module):
    slipstream_kernel = "swiglu"

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = 4 * cfg.d_model
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            hidden = int(8 * cfg.d_model / 3 + 7) // 8 * 8  # same parameter count as the GELU MLP
            self.fc = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
            self.act: nn.Module = SwiGLU()
        else:
            self.fc = nn.Linear(cfg.d_model, hidden)
            self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.mlp != "swiglu")
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate, up)
        else:
            h = self.act(h)
        return self.dropout(self.proj(h))


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """[B, T] document ids -> [B, 1, T, T] bool mask: causal and within one document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int = 0):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor, attn_mask: object | None, cache: object | None = None) -> Tensor:
        """attn_mask: None (causal), a bool [B, 1, T, T] tensor (SDPA) or a FlexAttention BlockMask.

        cache: a key/value cache with Hugging Face's `update(k, v, layer_idx) -> (keys, values)`
        (serving's `SlotCache`); then attn_mask is a bool [B, 1, T, keys] tensor."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        elif isinstance(attn_mask, Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        else:
            if p > 0:
                raise ValueError("attention='flex' does not apply dropout; set dropout=0 or attention='sdpa'")
            y = _flex_attention(q, k, v, attn_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, attn_mask: object | None, cache: object | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    slipstream_convention = "shifted"  # labels arrive shifted; packed rows carry document_ids

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.loss_head = LMHeadLoss()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·d·T."""
        cfg = self.config
        n = self.num_parameters() - self.wpe.weight.numel()
        return 6 * n + 12 * cfg.n_layers * cfg.d_model * seq_len

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        cache: object | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        B, T = input_ids.shape
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.config.max_len}")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        attn_mask = attention_mask
        if document_ids is not None:
            attn_mask = self.document_mask(document_ids)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.blocks:
            x = block(x, attn_mask, cache)
        return self.ln_f(x)

    def document_mask(self, document_ids: Tensor) -> object:
        """Built once per forward and shared by every block (not rebuilt per layer)."""
        if document_attention_backend(self.config.attention, document_ids.device) == "flex":
            return document_block_mask(document_ids)
        return document_causal_mask(document_ids)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        reduction: Literal["mean", "sum", "none"] = "mean",
        cache: object | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Loss when labels are given (mean over non-ignored tokens by default), else logits.

        Serving passes `cache` (keys and values of earlier positions, see `Attention`) with a bool
        `attention_mask` [B, 1, T, keys] saying which cached keys each query sees.

        The mean is sum / count with the count kept on the device (mask-free, no .item()), and a
        batch without a single real token gives 0 rather than nan (an all-padding batch can occur
        at the end of a sharded epoch).
        """
        h = self.hidden_states(input_ids, position_ids, document_ids, cache, attention_mask)
        if labels is None:
            return self.lm_head(h)
        head_reduction = "sum" if reduction == "mean" else reduction
        loss = self.loss_head(
            h.reshape(-1, h.shape[-1]), self.lm_head.weight, labels.reshape(-1), head_reduction
        )
        if reduction == "mean":
            return loss / count_tokens(labels, IGNORE_INDEX).clamp(min=1)
        return loss.view(labels.shape) if reduction == "none" else loss


def build_gpt(size: str = "tiny", max_len: int | None = None, **overrides) -> GPT:
    if size not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {', '.join(GPT_SIZES)}")
    cfg = GPT_SIZES[size]
    if max_len is not None:
        overrides["max_len"] = max_len
    if overrides:
        from dataclasses import replace

        cfg = replace(cfg, **overrides)
    return GPT(cfg)
