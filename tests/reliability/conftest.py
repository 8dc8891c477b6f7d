"""Fixtures of the bad-input catalogue (test_bad_*.py): the bad files, a real checkpoint to damage,
a busy port. Nothing here is autouse: the kill and disk-full tests in this folder are untouched."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from _bad_input import FAST


@pytest.fixture(scope="session")
def bad(tmp_path_factory) -> Path:
    """A folder of bad inputs, made once: data, recipes, tokenizers, checkpoints, and files a
    failed command must leave alone."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_bytes(b"")
    (d / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (d / "latin1.txt").write_bytes("caf\xe9 au lait\n\nune autre phrase ici\n".encode("latin-1"))
    (d / "one_line.txt").write_text("x" * 1_000_000 + "\n")  # one huge line: one document
    (d / "too_long.jsonl").write_text("\n".join(json.dumps({"text": "a" * 500 + str(i)}) for i in range(6)))
    (d / "no_field.jsonl").write_text('{"body": "hello there"}\n{"body": "and again"}\n')
    (d / "not_json.jsonl").write_text('{"text": "fine"}\nthis is not json\n')
    (d / "empty_dir").mkdir()
    (d / "a_file").write_text("a file, not a folder\n")
    # recipes
    (d / "malformed.toml").write_text("[shapes\nmax_len = 3\n")
    (d / "malformed.json").write_text('{"shapes": ')
    (d / "unknown_section.toml").write_text("[nosuch]\nx = 1\n")
    (d / "unknown_field.toml").write_text("[shapes]\nmax_lenn = 64\n")
    (d / "wrong_type.toml").write_text('[shapes]\nmax_len = "long"\n')
    (d / "out_of_range.toml").write_text("[shapes]\nmax_len = -5\n")
    (d / "nan.toml").write_text("[optimizer]\nlr = nan\n")
    (d / "list.json").write_text("[1, 2]")
    (d / "binary.toml").write_bytes(b"\xff\xfe\x00\x01garbage")
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "recipe.yaml").write_text("shapes:\n  max_len: 64\n")
    (d / "existing.toml").write_text('name = "mine"\n\n[shapes]\nmax_len = 128\n')
    (d / "existing.json").write_text('{"mine": true}\n')
    # tokenizers
    (d / "garbage_tok").mkdir()
    (d / "garbage_tok" / "tokenizer.json").write_text("{garbage")
    # checkpoints that are not checkpoints
    for name, data in (("not_ckpt", b"not a checkpoint\n"), ("json_ckpt", b'{"step": 3}\n')):
        (d / name).mkdir()
        (d / name / "checkpoint.pt").write_bytes(data)
    return d


@pytest.fixture(scope="session")
def ck(tmp_path_factory, bad) -> Path:
    """A real 2-step checkpoint (tiny GPT, recipe FAST), and a truncated copy in bad/truncated."""
    import slipstream

    d = tmp_path_factory.mktemp("ck")
    slipstream.train(
        "gpt-stdlib", FAST, 2, size="tiny", eval_every=0, checkpoint_dir=d, checkpoint_every=2, progress=False
    )
    data = (d / "checkpoint.pt").read_bytes()
    (bad / "truncated").mkdir(exist_ok=True)
    (bad / "truncated" / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    shutil.copy(d / "checkpoint.pt", bad / "full.pt")
    return d


@pytest.fixture(scope="session")
def busy_port():
    """A loopback port some other process holds (listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]
