import numpy as np
import pytest

from slipstream.workloads.corpus import (
    BOS_ID,
    EOS_ID,
    CorpusError,
    LengthStats,
    TokenCorpus,
    decode,
    load_stdlib_corpus,
    split_source,
)

SOURCE = '''"""Module doc."""
import os


@decorator
def f(x):
    return x


class C:
    def m(self):
        pass
'''


def test_split_source_gives_header_and_top_level_defs():
    docs = split_source(SOURCE)
    assert docs[0].startswith('"""Module doc."""') and "import os" in docs[0]
    assert docs[1].startswith("@decorator\ndef f(x):")
    assert docs[2].startswith("class C:") and "def m(self)" in docs[2]
    assert len(docs) == 3


def test_split_source_skips_unparsable_files():
    assert split_source("def (:\n") == []


def test_small_corpus_is_cached_framed_and_split(tmp_path):
    c = load_stdlib_corpus(cache_dir=tmp_path, max_files=40)
    assert len(c.train) > 10
    doc = c.train[0]
    assert doc[0] == BOS_ID and doc[-1] == EOS_ID
    assert decode(doc).strip()
    stamp = (c.path / "tokens.u16").stat().st_mtime_ns
    again = load_stdlib_corpus(cache_dir=tmp_path, max_files=40)
    assert (again.path / "tokens.u16").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert np.array_equal(again.train.lengths, c.train.lengths)
    assert "py3" in c.path.name  # keyed by Python version


def test_damaged_cache_names_the_fix(tmp_path):
    c = load_stdlib_corpus(cache_dir=tmp_path, max_files=20)
    (c.path / "offsets.i64").write_bytes(b"\0" * 8)
    with pytest.raises(CorpusError, match="delete that folder"):
        load_stdlib_corpus(cache_dir=tmp_path, max_files=20)


def test_length_stats():
    s = LengthStats.of(np.array([1, 2, 3, 4, 100]))
    assert (s.documents, s.median, s.max, s.total_tokens) == (5, 3.0, 100, 110)


def test_token_corpus_rejects_bad_offsets():
    with pytest.raises(CorpusError):
        TokenCorpus(np.zeros(5, np.uint16), np.array([0, 3]))
