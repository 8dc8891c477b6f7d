"""Loading a model for serving: the built-in GPT, or a Hugging Face causal LM from a local folder.

Weights load safely: `.safetensors` through safetensors, anything else through
`torch.load(weights_only=True)` as a slipstream training checkpoint (`{"model", "identity"}`).
A Hugging Face folder (`save_pretrained`: config, safetensors weights, tokenizer) loads through
`AutoModelForCausalLM.from_pretrained(local_files_only=True, use_safetensors=True)`: nothing is
downloaded and no pickle is unpickled.

`LoadedModel` hides what differs between the two families from the engines: how a forward reads
a key/value cache (`cached_logits`), how per-token losses are computed (`token_nll`), and the
tokenizer (`codec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipe import RecipeError
from .text import ByteCodec, HFCodec


@dataclass(frozen=True)
class KVLayout:
    n_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    """The model in eval mode on its device."""
    workload: str
    size: str
    max_len: int
    """Longest sequence served (the model's position table, or less with --max-len)."""
    vocab_size: int
    source: str
    """Where the weights came from: a path, or 'random-init'."""
    family: Literal["gpt", "hf"] = "gpt"
    codec: ByteCodec | HFCodec = field(default_factory=ByteCodec)
    name: str = "slipstream-gpt"
    """The model id clients name in OpenAI requests (/v1/models)."""
    saved_dtype: str = "fp32"
    """The dtype the weights were saved in (fp32, bf16 or fp16): the model is loaded in it, and
    `--quantize none` (the default) serves it unchanged."""
    saved_dtype_source: str = "random init"
    """Where saved_dtype was read: the config's dtype, the checkpoint's tensors, or a random init."""

    @property
    def kv(self) -> KVLayout:
        if self.family == "gpt":
            cfg = self.model.config
            return KVLayout(cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads)
        cfg = self.model.config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return KVLayout(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim)

    @property
    def pad_id(self) -> int:
        return self.codec.pad_id

    def cached_logits(self, model, ids: Tensor, positions: Tensor, cache, mask: Tensor, last: Tensor | None):
        """Logits of a forward that reads and writes `cache` (a `kv.SlotCache`).

        ids, positions: [B, T]; mask: bool [B, 1, T, keys]; `last` ([B] indices): return only
        those positions' logits [B, V] (a prefill needs one per row), else [B, T, V].
        `model` is `self.model` or a compiled callable of it."""
        if self.family == "gpt":
            if last is None:
                return model(ids, position_ids=positions, cache=cache, attention_mask=mask)
            h = self.model.hidden_states(ids, positions, None, cache, mask)
            return self.model.lm_head(h[torch.arange(ids.shape[0], device=ids.device), last])
        if self.model.config._attn_implementation == "eager":
            from .kv import additive

            mask = additive(mask, self.model.dtype)
        kwargs = {self._hf_cache_kw: cache}
        if last is not None:
            kwargs["logits_to_keep"] = last  # [B, B, V]: row i's logits at every row's index
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **kwargs)
        logits = out.logits
        if last is not None:
            rows = torch.arange(ids.shape[0], device=logits.device)
            return logits[rows, rows]
        return logits

    @cached_property
    def _hf_cache_kw(self) -> str:
        """transformers 5 renamed past_key_values to cache; read once (a signature walk per
        decode step would sit on the hot path)."""
        from ..models.convention import takes_keyword

        return "cache" if takes_keyword(self.model, "cache") else "past_key_values"

    def token_nll(self, model, x: Tensor, labels: Tensor) -> Tensor:
        """[B, T] negative log-likelihood of labels (already shifted: labels[t] follows x[t]),
        -100 ignored (0 there). `model` is `self.model` or a compiled callable of it."""
        if self.family == "gpt":
            return model(x, labels=labels, reduction="none")
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _saved_state_dtype(state: dict[str, torch.Tensor], path: Path) -> tuple[str, str]:
    """The one floating dtype of a checkpoint's tensors (fp32 when they mix or hold another)."""
    found = {v.dtype for v in state.values() if torch.is_tensor(v) and v.is_floating_point()}
    if len(found) == 1 and (d := next(iter(found))) in DTYPE_NAMES:
        return DTYPE_NAMES[d], f"the tensors in {path.name}"
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found)) or "none floating"
    return "fp32", f"{path.name} holds {names}: loaded as fp32"


def _saved_hf_dtype(folder: Path) -> tuple[str, str]:
    """config.json's dtype (transformers 5 writes `dtype`, 4.x `torch_dtype`); fp32 when unset."""
    import json

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    raw = config.get("dtype") or config.get("torch_dtype")
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    if raw is None:
        return "fp32", "config.json sets no dtype: fp32"
    if str(raw) not in names:
        return "fp32", f"config.json dtype {raw}: loaded as fp32"
    return names[str(raw)], f"config.json dtype {raw}"


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
    saved, saved_source = "fp32", "random init"
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
        saved, saved_source = _saved_state_dtype(state, path)
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
    model.to(device, TORCH_DTYPES[saved]).eval()  # the weights as saved (load_state_dict cast them to fp32)
    cfg = getattr(model, "config", None)
    return LoadedModel(
        model=model,
        workload=workload,
        size=size,
        max_len=int(getattr(cfg, "max_len", max_len)),
        vocab_size=int(getattr(cfg, "vocab_size", 264)),
        source=source,
        saved_dtype=saved,
        saved_dtype_source=saved_source,
    )


def load_hf_model(
    folder: str | Path,
    device: str | torch.device = "cpu",
    max_len: int | None = None,
    name: str | None = None,
) -> LoadedModel:
    """A Hugging Face causal LM and its tokenizer from a local `save_pretrained` folder."""
    path = Path(folder)
    if not (path / "config.json").exists():
        raise RecipeError(
            f"--model {path}: no config.json there; give a folder written by save_pretrained "
            "(or `slipstream train --export DIR`)"
        )
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as err:
        raise RecipeError(f"--model needs transformers: pip install 'slipstream[hf]' ({err})") from err
    saved, saved_source = _saved_hf_dtype(path)
    try:
        # The dtype is passed, not left to transformers: 4.x loads fp32 whatever was saved, 5.x the
        # config's dtype; served answers should equal `generate` on the model as the user saved it.
        model = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            use_safetensors=True,
            attn_implementation="sdpa",
            dtype=TORCH_DTYPES[saved],
        )
    except (OSError, ValueError) as err:
        raise RecipeError(
            f"--model {path}: transformers could not load it as a causal LM with safetensors weights: {err}"
        ) from err
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((path / f).exists() for f in files):
        # transformers would build an empty tokenizer from the config alone and serve garbage
        raise RecipeError(
            f"--model {path}: no tokenizer saved beside the model (none of {', '.join(files)}); "
            "save it there with tokenizer.save_pretrained(folder)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RecipeError(f"--model {path}: the tokenizer beside the model does not load ({err})") from err
    model.to(device).eval()
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    cfg = model.config.get_text_config()
    own = getattr(cfg, "max_position_embeddings", None) or max_len or 2048
    return LoadedModel(
        model=model,
        workload="huggingface",
        size=type(model).__name__,
        max_len=min(own, max_len) if max_len else own,
        vocab_size=int(cfg.vocab_size),
        source=str(path),
        family="hf",
        codec=HFCodec(tokenizer, eos_ids, pad),
        name=name or path.resolve().name,
        saved_dtype=saved,
        saved_dtype_source=saved_source,
    )
