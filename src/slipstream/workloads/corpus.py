"""The built-in corpus: the running interpreter's standard library, split into documents.

Every machine with Python has it, offline, and its document lengths are genuinely skewed (many
short functions, a long tail of big classes) — the case where padding wastes most of the device.
Documents are module headers (everything before the first top-level def/class) and top-level
functions and classes with their decorators. Tokens are bytes, framed by BOS and EOS.

The tokens are built once and cached as memory-mapped arrays (tokens + offsets) under the cache
dir, keyed by the Python version and corpus format, so a new interpreter rebuilds it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 264  # 259 used ids, rounded up to a multiple of 8 for friendlier matmuls

CORPUS_FORMAT = 1
DEFAULT_MAX_FILES = 2000
VALIDATION_PERCENT = 5
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}


class CorpusError(RuntimeError):
    """The corpus could not be built or read; the message says how to fix it."""


def default_cache_dir() -> Path:
    env = os.environ.get("SLIPSTREAM_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slipstream"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_source(text: str) -> list[str]:
    """Split one module's source into documents: header, then each top-level def/class."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    spans = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            spans.append((start, node.end_lineno or node.lineno))
    docs = []
    header_end = spans[0][0] if spans else len(lines)
    header = "".join(lines[:header_end]).strip("\n")
    if header.strip():
        docs.append(header + "\n")
    for start, end in spans:
        docs.append("".join(lines[start:end]))
    return docs


@dataclass(frozen=True)
class LengthStats:
    """Token lengths of a set of documents (BOS and EOS included)."""

    documents: int
    total_tokens: int
    mean: float
    median: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthStats:
        if len(lengths) == 0:
            return cls(0, 0, 0.0, 0.0, 0.0, 0.0, 0)
        return cls(
            documents=int(len(lengths)),
            total_tokens=int(lengths.sum()),
            mean=float(lengths.mean()),
            median=float(np.percentile(lengths, 50)),
            p90=float(np.percentile(lengths, 90)),
            p99=float(np.percentile(lengths, 99)),
            max=int(lengths.max()),
        )


class TokenCorpus:
    """Documents as one memory-mapped token array plus offsets; doc i is tokens[off[i]:off[i+1]]."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, name: str = "corpus"):
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
            raise CorpusError(
                f"{name}: offsets do not describe the token array; delete the cache and rebuild"
            )
        self.tokens = tokens
        self.offsets = offsets
        self.name = name

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def subset(self, indices: np.ndarray, name: str) -> TokenCorpus:
        """A compacted copy holding only `indices` (in that order)."""
        parts = [self[int(i)] for i in indices]
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=self.tokens.dtype)
        return TokenCorpus(tokens, offsets, name)

    def stats(self) -> LengthStats:
        return LengthStats.of(self.lengths)


@dataclass
class StdlibCorpus:
    train: TokenCorpus
    validation: TokenCorpus
    path: Path
    files: int


def _cache_key(max_files: int) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    tag = hashlib.sha1(f"{stdlib_dir()}|{max_files}|{CORPUS_FORMAT}".encode()).hexdigest()[:8]
    return f"stdlib-py{version}-v{CORPUS_FORMAT}-{tag}"


def _source_files(max_files: int) -> list[Path]:
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                files.append(Path(dirpath) / fn)
    files.sort(key=lambda p: str(p.relative_to(root)))
    return files[:max_files]


def build_corpus(out_dir: Path, max_files: int = DEFAULT_MAX_FILES) -> None:
    """Tokenise the stdlib into out_dir (written to a temp dir, then renamed: never half-built)."""
    root = stdlib_dir()
    files = _source_files(max_files)
    if not files:
        raise CorpusError(f"no .py files found under {root}; is this a full Python install?")
    docs: list[bytes] = []
    is_val: list[bool] = []
    for path in files:
        rel = str(path.relative_to(root))
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Split by file, not by document, so validation never sees a sibling of a training doc.
        val = zlib.crc32(rel.encode()) % 100 < VALIDATION_PERCENT
        for doc in split_source(text):
            docs.append(doc.encode("utf-8"))
            is_val.append(val)
    lengths = np.array([len(d) + 2 for d in docs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.uint16)
    for i, d in enumerate(docs):
        a = offsets[i]
        tokens[a] = BOS_ID
        tokens[a + 1 : a + 1 + len(d)] = np.frombuffer(d, dtype=np.uint8)
        tokens[a + 1 + len(d)] = EOS_ID
    meta = {"python": sys.version, "stdlib": str(root), "files": len(files), "format": CORPUS_FORMAT}
    write_token_cache(out_dir, tokens, offsets, np.array(is_val, dtype=np.bool_), meta)


_TOKEN_FILES = {"uint16": "tokens.u16", "int32": "tokens.i32"}


def write_token_cache(
    out_dir: Path, tokens: np.ndarray, offsets: np.ndarray, is_val: np.ndarray, meta: dict
) -> None:
    """Documents (tokens[offsets[i]:offsets[i+1]]) and their split, memory-mappable, with `meta`:
    written to a temp dir beside `out_dir`, then renamed, so a cache is never half-built."""
    dtype = np.dtype(tokens.dtype).name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        tokens.tofile(tmp / _TOKEN_FILES[dtype])
        offsets.tofile(tmp / "offsets.i64")
        is_val.astype(np.bool_).tofile(tmp / "is_val.bool")
        meta = {**meta, "documents": len(offsets) - 1, "tokens": int(offsets[-1]), "dtype": dtype}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_token_cache(out_dir: Path, name: str) -> tuple[TokenCorpus, TokenCorpus, dict]:
    """(train, validation, meta) of a cache written by write_token_cache; a damaged one raises
    CorpusError naming the folder to delete."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        dtype = meta.get("dtype", "uint16")
        tokens = np.memmap(out_dir / _TOKEN_FILES[dtype], dtype=np.dtype(dtype), mode="r")
        offsets = np.fromfile(out_dir / "offsets.i64", dtype=np.int64)
        is_val = np.fromfile(out_dir / "is_val.bool", dtype=np.bool_)
        if len(tokens) != meta["tokens"] or len(is_val) != meta["documents"]:
            raise CorpusError("size mismatch")
        whole = TokenCorpus(tokens, offsets, name)
    except (OSError, ValueError, KeyError, CorpusError) as err:
        raise CorpusError(
            f"token cache at {out_dir} is damaged ({err}); delete that folder to rebuild it"
        ) from err
    idx = np.arange(len(whole))
    return whole.subset(idx[~is_val], f"{name}/train"), whole.subset(idx[is_val], f"{name}/validation"), meta


def load_stdlib_corpus(cache_dir: Path | None = None, max_files: int = DEFAULT_MAX_FILES) -> StdlibCorpus:
    """Build on first use, then memory-map. Rebuilds when the Python version or format changes."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / "corpus" / _cache_key(max_files)
    if not (out / "meta.json").exists():
        build_corpus(out, max_files)
    train, validation, meta = read_token_cache(out, "stdlib")
    return StdlibCorpus(train=train, validation=validation, path=out, files=int(meta["files"]))


def decode(tokens: np.ndarray | list[int]) -> str:
    """Bytes back to text, dropping the special ids."""
    data = bytes(int(t) for t in tokens if int(t) < BYTE_VOCAB)
    return data.decode("utf-8", errors="replace")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of `text`, stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def copyright_paragraphs(root: Path = Path("/usr/share/doc")) -> list[str]:
    """Paragraphs of the Debian copyright files under `root` (`/usr/share/doc/*/copyright`): real
    English text on every Debian-family machine, offline, from a few words to whole licence texts.
    Files that are not UTF-8 are skipped."""
    texts = []
    for path in sorted(Path(root).glob("*/copyright")):
        try:
            texts += paragraphs(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts
