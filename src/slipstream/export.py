"""Write a trained model where other tools can load it, never half-written.

- A Hugging Face `PreTrainedModel`: `save_pretrained(safe_serialization=True)`, so
  `AutoModelForCausalLM.from_pretrained(out)` loads it; its tokenizer is saved beside it.
- Any other `nn.Module`: `model.safetensors` (its state_dict, tied weights stored once) and
  `slipstream_export.json` naming the factory that builds the architecture, because a state_dict
  alone cannot rebuild a plain module: `load_export(out)` calls the factory and loads the weights.

Both are written to a temp folder beside `out_dir` and renamed into place. An existing `out_dir` is
replaced only when it is an earlier export (it holds slipstream_export.json): anything else the user
had there is refused, not overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from .models import is_hf_model, unwrap
from .recipe import RecipeError

MARKER = "slipstream_export.json"
FORMAT = 1


def check_export_dir(out_dir: str | Path) -> Path:
    """`out_dir` as a Path, refused when it holds something other than an earlier export (checked
    again before a run trains, so a bad --export fails in a second, not after the run)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise RecipeError(
            f"--export {out} exists and is not an earlier export; choose an empty or new folder"
        )
    return out


def export_model(
    model: nn.Module, out_dir: str | Path, tokenizer: Any = None, factory: str | None = None
) -> Path:
    """Write `model` (and `tokenizer`: a transformers tokenizer, or a `tokenizers.Tokenizer`) to
    `out_dir`. `factory` (`module:function`) is recorded for plain modules so they can be rebuilt."""
    model = unwrap(model)  # torch.compile's wrapper would prefix every key
    out = check_export_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        meta: dict[str, Any] = {
            "format": FORMAT,
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
        }
        if is_hf_model(model):
            model.save_pretrained(tmp, safe_serialization=True)
            meta["kind"] = "huggingface"
        else:
            from safetensors.torch import save_model

            save_model(model, str(tmp / "model.safetensors"))  # drops tied duplicates, unlike save_file
            meta["kind"] = "state_dict"
            meta["factory"] = factory
            from .workloads.gpt import GPT

            if isinstance(model, GPT):  # the built-in GPT: its config rebuilds it
                from dataclasses import asdict

                meta["config"] = asdict(model.config)
        _save_tokenizer(tokenizer, tmp)
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
            os.replace(out, old / "x")  # move aside first: the new export lands in one rename
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    elif hasattr(tokenizer, "to_str"):  # a bare tokenizers.Tokenizer
        tokenizer.save(str(folder / "tokenizer.json"))
    else:
        raise RecipeError(f"cannot export a tokenizer of type {type(tokenizer).__name__}")


def load_export(out_dir: str | Path) -> nn.Module:
    """The model written by export_model (Hugging Face models through AutoModelForCausalLM)."""
    out = Path(out_dir)
    if not (out / MARKER).exists():
        raise RecipeError(f"{out} holds no {MARKER}; it is not a slipstream export")
    meta = json.loads((out / MARKER).read_text())
    if meta["kind"] == "huggingface":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    from safetensors.torch import load_model

    if meta.get("factory"):
        from .workloads.user import build_user_model

        model = build_user_model(meta["factory"])
    elif meta.get("config"):
        from .workloads.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(**meta["config"]))
    else:
        raise RecipeError(
            f"{out}: no factory recorded to rebuild {meta['class']}; build it, then load_model()"
        )
    load_model(model, str(out / "model.safetensors"))
    return model


def export_workload_model(model: nn.Module, out_dir: str | Path, workload: str) -> Path:
    """export_model with what the workload knows: its tokenizer and the factory of its model."""
    tokenizer = factory = None
    if workload.startswith("user:"):
        from .workloads.user import UserWorkload, parse_user_name

        spec = parse_user_name(workload)
        factory = spec.model
        if spec.tokenizer:
            tok = UserWorkload(spec).tokenizer
            tokenizer = tok.hf if tok.hf is not None else tok.raw
    return export_model(model, out_dir, tokenizer=tokenizer, factory=factory)
