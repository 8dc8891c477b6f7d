"""Loading a model for serving, and the byte tokenizer of the built-in corpus.

Weights load safely: `.safetensors` through safetensors, anything else through
`torch.load(weights_only=True)` as a slipstream training checkpoint (`{"model", "identity"}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..recipe import RecipeError
from ..workloads.corpus import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    """The model in eval mode on its device; forward(input_ids, labels=, reduction=) as GPT."""
    workload: str
    size: str
    max_len: int
    """Longest sequence the model embeds (from its position table)."""
    vocab_size: int
    source: str
    """Where the weights came from: a path, or 'random-init'."""


def _max_len_from_state(state: dict[str, torch.Tensor]) -> int | None:
    wpe = state.get("wpe.weight")
    return int(wpe.shape[0]) if wpe is not None else None


def load_model(
    workload: str = "gpt-stdlib",
    size: str | None = None,
    checkpoint: str | Path | None = None,
    device: str | torch.device = "cpu",
    max_len: int = 1024,
) -> LoadedModel:
    """Build the workload's model and load weights (random init when checkpoint is None)."""
    from ..workloads.registry import get_workload

    state: dict[str, torch.Tensor] | None = None
    source = "random-init"
    if checkpoint is not None:
        path = Path(checkpoint)
        if path.is_dir():
            path = path / "checkpoint.pt"
        if not path.exists():
            raise RecipeError(
                f"--checkpoint {path} does not exist; give a checkpoint.pt, its folder, or a .safetensors file"
            )
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            from ..checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(path)
            except CheckpointError as err:
                raise RecipeError(str(err)) from err
            state = ckpt["model"]
            identity = ckpt.get("identity", {})
            ck_workload, ck_size = identity.get("workload"), identity.get("size")
            if ck_workload and ck_workload != workload:
                raise RecipeError(
                    f"checkpoint {path} is for workload {ck_workload!r}, not {workload!r}; pass --workload {ck_workload}"
                )
            if size is not None and ck_size and ck_size != size:
                raise RecipeError(
                    f"checkpoint {path} holds size {ck_size!r}, not {size!r}; drop --size or pass --size {ck_size}"
                )
            size = size or ck_size
        source = str(path)
        max_len = _max_len_from_state(state) or max_len
    size = size or "small"
    model = get_workload(workload).model(size, max_len)
    if state is not None:
        state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        # lm_head.weight is tied to wte.weight; a state dict may carry it under either name.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RecipeError(
                f"weights in {source} do not fit {workload}/{size}: missing {missing[:4]}, unexpected {unexpected[:4]}; "
                "check --size"
            )
    model.to(device).eval()
    cfg = getattr(model, "config", None)
    return LoadedModel(
        model=model,
        workload=workload,
        size=size,
        max_len=int(getattr(cfg, "max_len", max_len)),
        vocab_size=int(getattr(cfg, "vocab_size", 264)),
        source=source,
    )


def encode_text(text: str, bos: bool = True) -> list[int]:
    """UTF-8 bytes as token ids, optionally after BOS (the corpus frames documents BOS ... EOS)."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if bos else ids


def decode_tokens(tokens: list[int]) -> str:
    """Byte tokens back to text; special ids (BOS, EOS, PAD, unused) are dropped."""
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


SPECIAL_TOKENS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}
