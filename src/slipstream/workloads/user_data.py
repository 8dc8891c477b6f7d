"""The user's own text and tokenizer, turned into the token corpora every command trains on.

Accepted data (`--data PATH`):
- a folder saved with `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: its "train" split,
  and "validation" or "test" as the held-out split when present),
- a `.jsonl` file, one JSON object per line, the text under `--text-field` (default `text`),
- a folder of text files: one document per file (recursive, sorted, hidden files skipped),
- any other file: UTF-8 text, one document per blank-line-separated paragraph (a single big file
  is many documents, not one: the shape planner needs the real length distribution).

Tokenizers (`--tokenizer PATH`): a local Hugging Face tokenizer folder, or by default the built-in
byte tokens of corpus.py. Tokens are cached like the built-in corpus: memory-mapped arrays under the
cache dir, keyed by the data files' path/size/mtime, the tokenizer's files and the format, written
to a temp dir and renamed so a cache is never half-built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..recipe import RecipeError
from . import corpus
from .corpus import CorpusError, TokenCorpus

USER_FORMAT = 2  # 2: tokens.u16 / tokens.i32 (the built-in corpus's writer)
_PARAGRAPH = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # one or more blank (or whitespace-only) lines
_HF_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")


# --- documents -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Documents:
    train: list[str]
    validation: list[str] | None
    """The data's own held-out split; None: split train deterministically."""
    kind: str


def data_files(path: Path) -> list[Path]:
    """Every file whose change must invalidate the cache (and, for a text folder, the documents)."""
    if path.is_file():
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return sorted(files, key=lambda p: str(p.relative_to(path)))


def data_kind(path: Path) -> str:
    if not path.exists():
        raise CorpusError(f"--data {path}: no such file or folder; pass a text file, a .jsonl, or a folder")
    if path.is_dir():
        return "hf-dataset" if any((path / m).exists() for m in _HF_MARKERS) else "text-folder"
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "text"


def read_documents(path: Path, text_field: str = "text") -> Documents:
    kind = data_kind(path)
    if kind == "hf-dataset":
        docs = _hf_documents(path, text_field)
    elif kind == "jsonl":
        docs = Documents(_jsonl_documents(path, text_field), None, kind)
    elif kind == "text-folder":
        files = data_files(path)
        docs = Documents([t for f in files if (t := _read_text(f)).strip()], None, kind)
    else:
        paras = _PARAGRAPH.split(_read_text(path))
        docs = Documents([p.strip("\n") for p in paras if p.strip()], None, kind)
    if not docs.train:
        raise CorpusError(f"--data {path}: no documents found (empty?); give it some text")
    return docs


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        if b"\x00" in data:  # NUL bytes are valid UTF-8, but never text anyone means to train on
            raise UnicodeDecodeError("utf-8", data, data.index(b"\x00"), data.index(b"\x00") + 1, "NUL")
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"--data {path} is not UTF-8 text (binary? byte {err.start}); pass text, .jsonl or a datasets folder"
        ) from None


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    docs = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(
                f"--data {path} line {n} is not JSON ({err.msg}); one object per line"
            ) from None
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise CorpusError(
                f"--data {path} line {n} has no field {text_field!r} (has: {keys}); pass --text-field NAME"
            )
        if not isinstance(row[text_field], str):
            raise CorpusError(f"--data {path} line {n}: field {text_field!r} is not a string")
        if row[text_field].strip():
            docs.append(row[text_field])
    return docs


def _hf_documents(path: Path, text_field: str) -> Documents:
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--data {path} is a datasets folder: pip install 'slipstream[hf]'") from None
    try:
        ds: Any = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise CorpusError(f"--data {path}: cannot read the saved dataset ({err}); save it again") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise CorpusError(f"--data {path} has splits {', '.join(ds)} but no 'train'; name one 'train'")
        held = next((ds[s] for s in ("validation", "test") if s in ds), None)
        train, validation = ds["train"], held
    else:
        train, validation = ds, None

    def texts(split: Any) -> list[str]:
        if text_field not in split.column_names:
            raise CorpusError(
                f"--data {path} has no column {text_field!r} (has: {', '.join(split.column_names)}); "
                "pass --text-field NAME"
            )
        return [t for t in split[text_field] if isinstance(t, str) and t.strip()]

    val = texts(validation) if validation is not None else None
    return Documents(texts(train), val or None, "hf-dataset")


# --- tokenizers ----------------------------------------------------------------------------------


class ByteTokenizer:
    """corpus.py's tokens: UTF-8 bytes framed by BOS/EOS, so --data alone needs nothing installed."""

    bos_id, eos_id, pad_id = corpus.BOS_ID, corpus.EOS_ID, corpus.PAD_ID
    vocab_size = corpus.VOCAB_SIZE
    id_limit = corpus.PAD_ID + 1
    fingerprint = "bytes-v1"
    hf = None

    def encode(self, texts: Sequence[str]) -> Iterator[list[int]]:
        for t in texts:
            yield list(t.encode("utf-8"))


class HFTokenizer:
    """A local Hugging Face tokenizer: transformers' AutoTokenizer, or a bare `tokenizers` file."""

    def __init__(self, path: Path):
        self.path = path
        self.hf, self.raw = _load_hf_tokenizer(path)
        if self.hf is not None:
            self.bos_id, self.eos_id, pad = self.hf.bos_token_id, self.hf.eos_token_id, self.hf.pad_token_id
            self.id_limit = len(self.hf)
            vocab = self.hf.get_vocab()
        else:
            self.bos_id = self.eos_id = pad = None
            self.id_limit = self.raw.get_vocab_size(with_added_tokens=True)
            vocab = self.raw.get_vocab(with_added_tokens=True)
        if self.bos_id is None and self.eos_id is None:
            # A bare tokenizer.json declares no roles: take the conventional names of its specials.
            self.bos_id = _first_id(vocab, ("<s>", "<bos>", "<|begin_of_text|>", "[BOS]"))
            self.eos_id = _first_id(vocab, ("</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "[EOS]"))
            pad = pad if pad is not None else _first_id(vocab, ("<pad>", "[PAD]", "<|pad|>"))
        self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else 0
        self.vocab_size = self.id_limit
        self.fingerprint = _files_fingerprint(path)

    def encode(self, texts: Sequence[str]) -> Iterator[list[int]]:
        for i in range(0, len(texts), 1000):  # batches: fast tokenizers parallelise within a call
            chunk = list(texts[i : i + 1000])
            if self.hf is not None:
                yield from self.hf(chunk, add_special_tokens=False)["input_ids"]
            else:
                yield from (e.ids for e in self.raw.encode_batch(chunk, add_special_tokens=False))


def _first_id(vocab: dict[str, int], names: Sequence[str]) -> int | None:
    return next((vocab[n] for n in names if n in vocab), None)


def _load_hf_tokenizer(path: Path) -> tuple[Any, Any]:
    """(transformers tokenizer, None), or (None, tokenizers.Tokenizer) when only tokenizer.json is usable."""
    fix = "save one there with tokenizer.save_pretrained(PATH)"
    if path.is_file() and path.suffix == ".json":
        folder, file = path.parent, path
    else:
        folder, file = path, path / "tokenizer.json"
    if not folder.is_dir():
        raise RecipeError(f"--tokenizer {path}: no such folder; {fix}")
    if not file.exists() and not (folder / "tokenizer_config.json").exists():
        raise RecipeError(f"--tokenizer {path} is not a tokenizer folder (no tokenizer.json); {fix}")
    if path.is_dir():
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True), None
        except ImportError:
            pass  # tokenizers alone reads tokenizer.json below
        except (OSError, ValueError, KeyError, TypeError) as err:
            if not file.exists():
                raise RecipeError(f"--tokenizer {path}: transformers cannot load it ({err}); {fix}") from None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RecipeError(f"--tokenizer {path}: pip install 'slipstream[hf]'") from None
    try:
        return None, Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise RecipeError(f"--tokenizer {path}: {file.name} is not a tokenizer ({err}); {fix}") from None


def _files_fingerprint(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(Path(path)) if path else ByteTokenizer()


# --- tokenized, cached corpora -------------------------------------------------------------------


@dataclass
class UserCorpus:
    train: TokenCorpus
    validation: TokenCorpus
    path: Path


def cache_key(path: Path, tokenizer: ByteTokenizer | HFTokenizer, text_field: str) -> str:
    """Changes when any data file, the tokenizer or the format changes (path + size + mtime)."""
    h = hashlib.sha1(f"{USER_FORMAT}|{tokenizer.fingerprint}|{text_field}|{path.resolve()}\n".encode())
    for f in data_files(path):
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return f"{path.name[:40]}-v{USER_FORMAT}-{h.hexdigest()[:12]}"


def load_user_corpus(
    path: str | Path,
    tokenizer: ByteTokenizer | HFTokenizer,
    text_field: str = "text",
    cache_dir: Path | None = None,
) -> UserCorpus:
    path = Path(path)
    data_kind(path)  # a missing path fails here with the fix, before any hashing
    cache = Path(cache_dir) if cache_dir else corpus.default_cache_dir()
    out = cache / "user" / cache_key(path, tokenizer, text_field)
    if not (out / "meta.json").exists():
        _build(out, read_documents(path, text_field), tokenizer, path)
    train, validation, _ = corpus.read_token_cache(out, path.name)
    return UserCorpus(train=train, validation=validation, path=out)


def split_validation(texts: Sequence[str]) -> np.ndarray:
    """~VALIDATION_PERCENT% held out by a hash of the text (stable across runs and machines; equal
    texts land on the same side), never leaving either side empty."""
    is_val = np.array([zlib.crc32(t.encode()) % 100 < corpus.VALIDATION_PERCENT for t in texts], dtype=bool)
    if not is_val.any():
        is_val[-1] = True
    if is_val.all():
        is_val[0] = False
    return is_val


def _build(out: Path, docs: Documents, tokenizer: ByteTokenizer | HFTokenizer, path: Path) -> None:
    texts = docs.train + (docs.validation or [])
    if len(texts) < 2:
        raise CorpusError(
            f"--data {path} holds 1 document; training needs at least 2 "
            "(separate documents with a blank line, or give one per line in .jsonl)"
        )
    if docs.validation:
        is_val = np.array([False] * len(docs.train) + [True] * len(docs.validation))
    else:
        is_val = split_validation(texts)
    frame_head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    frame_tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    dtype = np.uint16 if tokenizer.id_limit <= 2**16 else np.int32
    parts = [np.asarray(frame_head + list(ids) + frame_tail, dtype=dtype) for ids in tokenizer.encode(texts)]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    meta = {
        "data": str(path.resolve()),
        "kind": docs.kind,
        "tokenizer": tokenizer.fingerprint,
        "format": USER_FORMAT,
    }
    corpus.write_token_cache(out, np.concatenate(parts).astype(dtype, copy=False), offsets, is_val, meta)
