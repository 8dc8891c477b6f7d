"""A workload made of the user's model, data and tokenizer (`--model`, `--data`, `--tokenizer`).

Every command passes workloads around by *name*, sometimes to a subprocess, so the user workload's
name describes it completely and `get_workload` rebuilds it from the name alone:

    user:model=mypkg.models:build;data=/abs/corpus.jsonl;tokenizer=/abs/tok;text_field=body

Keys are optional (a missing one means the built-in default: the GPT, the stdlib corpus, byte
tokens); paths are made absolute when the name is made, values are %-quoted so `;` and `=` in a
path cannot break the parse.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import shlex
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from torch import nn

from ..recipe import RecipeError
from .registry import Workload, WorkloadData, get_workload, register_family

PREFIX = "user:"
CUSTOM_SIZE = "custom"
"""The only size of a workload whose model comes from --model (the factory decides its size)."""
_KEYS = ("model", "data", "tokenizer", "text_field")


@dataclass(frozen=True)
class UserSpec:
    model: str | None = None
    """`module:factory`: factory() returns the nn.Module to train; None: the built-in GPT."""
    data: str | None = None
    """Text file, .jsonl, text folder or datasets folder; None: the built-in stdlib corpus."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer folder; None: byte tokens."""
    text_field: str = "text"
    """The JSONL field / dataset column holding the text."""

    @property
    def name(self) -> str:
        parts = [f"{k}={quote(str(v), safe='/:._-~@+,')}" for k, v in self._items()]
        return PREFIX + ";".join(parts)

    @property
    def slug(self) -> str:
        """A short file-name-safe label (the name holds paths)."""
        return "user-" + hashlib.sha1(self.name.encode()).hexdigest()[:8]

    def flags(self) -> list[str]:
        """The command-line flags that select this workload, quoted for a shell."""
        return [f"--{k.replace('_', '-')} {shlex.quote(v)}" for k, v in self._items()]

    def _items(self) -> list[tuple[str, str]]:
        items = [(k, getattr(self, k)) for k in _KEYS[:3] if getattr(self, k) is not None]
        if self.text_field != "text":
            items.append(("text_field", self.text_field))
        return items


def user_workload_name(
    model: str | None = None, data: str | None = None, tokenizer: str | None = None, text_field: str = "text"
) -> str:
    """The self-describing workload name; paths resolved against the current directory now, so the
    name still means the same files in a subprocess started elsewhere."""
    if model is not None and ":" not in model:
        raise RecipeError(f"--model {model!r}: give module:factory, e.g. --model mymodels:build")

    def absolute(p: str | None) -> str | None:
        return str(Path(p).expanduser().absolute()) if p else None

    return UserSpec(model, absolute(data), absolute(tokenizer), text_field).name


def parse_user_name(name: str) -> UserSpec:
    if not name.startswith(PREFIX):
        raise RecipeError(f"{name!r} is not a user workload name (it starts with {PREFIX!r})")
    fields: dict[str, str] = {}
    for part in filter(None, name[len(PREFIX) :].split(";")):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS:
            raise RecipeError(f"workload {name!r}: bad part {part!r}; keys are {', '.join(_KEYS)}")
        fields[key] = unquote(value)
    return UserSpec(**fields)


# --- the model -----------------------------------------------------------------------------------


def import_factory(spec: str) -> Any:
    """`module:factory` -> the callable; the current directory is importable, as `python -m` would have it."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RecipeError(f"--model {spec!r}: give module:factory, e.g. --model mymodels:build")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RecipeError(
            f"--model {spec}: cannot import {module_name!r} ({err}); run from the folder that holds it "
            "or pip install it"
        ) from None
    except Exception as err:  # the user's module failed while importing: say so in one line
        raise RecipeError(
            f"--model {spec}: importing {module_name!r} raised {type(err).__name__}: {err}"
        ) from err
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RecipeError(
            f"--model {spec}: {module_name!r} has no callable {attr!r}; it defines: {', '.join(found) or 'none'}"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise RecipeError(
            f"--model {spec}: {attr}() must take no arguments (wrap it: def build(): ...)"
        ) from None
    except ValueError:
        pass  # builtins without a signature: let the call decide
    return factory


def build_user_model(spec: str) -> nn.Module:
    model = import_factory(spec)()
    if not isinstance(model, nn.Module):
        raise RecipeError(
            f"--model {spec} returned {type(model).__name__}, not a torch.nn.Module; return the model itself"
        )
    return model


def model_vocab_size(model: nn.Module) -> int | None:
    """Token ids the model can embed: its config's vocab_size, else its input embedding's rows."""
    for cfg in (getattr(model, "config", None), getattr(model, "cfg", None)):
        v = getattr(cfg, "vocab_size", None)
        if isinstance(v, int):
            return v
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None


def model_max_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    return None


def check_model(model: nn.Module, id_limit: int, max_len: int, where: str) -> None:
    vocab = model_vocab_size(model)
    if vocab is not None and vocab < id_limit:
        raise RecipeError(
            f"{where}: the model embeds {vocab} token ids but the tokenizer emits up to {id_limit}; "
            f"build it with vocab_size >= {id_limit} (or model.resize_token_embeddings({id_limit}))"
        )
    positions = model_max_len(model)
    if positions is not None and positions < max_len:
        raise RecipeError(
            f"{where}: the model embeds {positions} positions but shapes.max_len is {max_len}; "
            f"pass --set shapes.max_len={positions} (or build the model longer)"
        )


# --- the workload --------------------------------------------------------------------------------


class UserWorkload:
    """Builds the model and data of a UserSpec; its tokenizer is loaded once and shared."""

    def __init__(self, spec: UserSpec):
        self.spec = spec

    @cached_property
    def tokenizer(self) -> Any:
        from .user_data import load_tokenizer

        return load_tokenizer(self.spec.tokenizer)

    def gpt_vocab(self) -> int:
        # The built-in GPT sized to the tokenizer, rounded up to a multiple of 64 for friendlier matmuls.
        return -(-self.tokenizer.vocab_size // 64) * 64 if self.spec.tokenizer else self.tokenizer.vocab_size

    def build_model(self, size: str, max_len: int) -> nn.Module:
        if self.spec.model is None:
            from .gpt import build_gpt

            return build_gpt(size, max_len=max_len, vocab_size=self.gpt_vocab())
        model = build_user_model(self.spec.model)
        check_model(model, self.tokenizer.id_limit, max_len, f"--model {self.spec.model}")
        return model

    def load_data(self) -> WorkloadData:
        if self.spec.data is None:
            if self.spec.tokenizer is not None:
                raise RecipeError("--tokenizer needs --data (the built-in corpus is byte tokens)")
            return get_workload("gpt-stdlib").load_data()
        from .user_data import load_user_corpus

        c = load_user_corpus(self.spec.data, self.tokenizer, self.spec.text_field)
        vocab = self.tokenizer.vocab_size if self.spec.model else self.gpt_vocab()
        return WorkloadData(
            train=c.train,
            validation=c.validation,
            train_lengths=c.train.lengths,
            validation_lengths=c.validation.lengths,
            pad_id=int(self.tokenizer.pad_id),
            vocab_size=vocab,
        )

    def workload(self, name: str) -> Workload:
        from .gpt import GPT_SIZES

        s = self.spec
        what = f"model {s.model or 'built-in GPT'} on {s.data or 'the stdlib corpus'}"
        what += f", tokenizer {s.tokenizer}" if s.tokenizer else ", byte tokens"
        return Workload(
            name=name,
            description=what,
            sizes=(CUSTOM_SIZE,) if s.model else tuple(GPT_SIZES),
            build_model=self.build_model,
            load_data=self.load_data,
        )


def user_workload(name: str) -> Workload:
    return UserWorkload(parse_user_name(name)).workload(name)


register_family("user", user_workload, lambda name: parse_user_name(name).slug)
