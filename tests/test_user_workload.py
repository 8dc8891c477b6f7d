"""The user's own model, data and tokenizer as a workload: formats, splits, caching, names that
survive a subprocess, and a one-line error with the fix for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from slipstream.cli import build_parser, main
from slipstream.commands import resolve_workload, workload_flags
from slipstream.recipe import RecipeError
from slipstream.workloads import get_workload, workload_slug
from slipstream.workloads.corpus import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from slipstream.workloads.user import CUSTOM_SIZE, parse_user_name, user_workload, user_workload_name
from slipstream.workloads.user_data import load_tokenizer, read_documents
from user_helpers import GPT2_FACTORY, paragraphs, train_tokenizer, write_module, write_text


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # model modules written to tmp_path import from the cwd
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def texts_of(corpus) -> list[list[int]]:
    return [list(map(int, corpus[i])) for i in range(len(corpus))]


# --- data formats ---------------------------------------------------------------------------------


def test_a_text_file_is_one_document_per_blank_line_separated_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("first para\nstill first\n\n  \nsecond\n\n\nthird\n")
    docs = read_documents(tmp_path / "a.txt")
    assert docs.train == ["first para\nstill first", "second", "third"]
    assert docs.validation is None


def test_jsonl_reads_the_text_field(tmp_path):
    rows = [{"body": "one", "id": 1}, {"body": "two"}, {"body": "  "}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_documents(tmp_path / "d.jsonl", text_field="body").train == ["one", "two"]


def test_a_folder_is_one_document_per_file_recursive_sorted_hidden_skipped(tmp_path):
    (tmp_path / "f" / "sub").mkdir(parents=True)
    (tmp_path / "f" / "b.txt").write_text("bee")
    (tmp_path / "f" / "a.md").write_text("ay\n\nstill ay")  # no paragraph split inside a file
    (tmp_path / "f" / "sub" / "c.txt").write_text("sea")
    (tmp_path / "f" / ".hidden").write_text("never")
    assert read_documents(tmp_path / "f").train == ["ay\n\nstill ay", "bee", "sea"]


def test_a_saved_datasetdict_uses_train_and_its_validation_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": paragraphs(10)}),
            "validation": datasets.Dataset.from_dict({"text": ["held out a", "held out b"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    docs = read_documents(tmp_path / "ds")
    assert docs.train == paragraphs(10) and docs.validation == ["held out a", "held out b"]
    data = get_workload(user_workload_name(data=str(tmp_path / "ds"))).load_data()
    assert len(data.train) == 10 and len(data.validation) == 2  # the data's own split, not a hash split


def test_a_saved_dataset_without_splits_is_split_by_hash(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": paragraphs(60)}).save_to_disk(str(tmp_path / "ds"))
    data = get_workload(user_workload_name(data=str(tmp_path / "ds"))).load_data()
    assert len(data.train) + len(data.validation) == 60 and 1 <= len(data.validation) < 15


# --- tokens, split, cache -------------------------------------------------------------------------


def test_default_tokens_are_corpus_bytes_framed_by_bos_eos(tmp_path):
    write_text(tmp_path / "n.txt", n=30)
    data = get_workload(user_workload_name(data="n.txt")).load_data()
    assert (data.pad_id, data.vocab_size) == (PAD_ID, VOCAB_SIZE)
    docs = texts_of(data.train) + texts_of(data.validation)
    assert all(d[0] == BOS_ID and d[-1] == EOS_ID for d in docs)
    assert sorted(bytes(d[1:-1]).decode() for d in docs) == sorted(paragraphs(30))


def test_hf_tokenizer_frames_with_bos_eos_and_pads_with_eos(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    write_text(tmp_path / "n.txt", n=30)
    data = get_workload(user_workload_name(data="n.txt", tokenizer=str(tok_dir))).load_data()
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    eos = hf.eos_token_id
    assert data.pad_id == eos  # no pad token: eos pads
    docs = texts_of(data.train) + texts_of(data.validation)
    assert all(d[0] == hf.bos_token_id and d[-1] == eos for d in docs)
    assert sorted(hf.decode(d[1:-1]) for d in docs) == sorted(paragraphs(30))


def test_a_bare_tokenizer_json_folder_works_too(tmp_path):
    folder = train_tokenizer(tmp_path / "bare", with_config=False)
    tok = load_tokenizer(str(folder))
    assert tok.eos_id is not None and tok.pad_id == tok.eos_id and tok.id_limit > 256


def test_validation_split_is_deterministic_nonempty_and_disjoint(tmp_path):
    write_text(tmp_path / "n.txt", n=80)
    name = user_workload_name(data="n.txt")
    a = get_workload(name).load_data()
    b = user_workload(name).load_data()  # a fresh build (not get_workload's memo) reads the cache
    assert texts_of(a.validation) == texts_of(b.validation) and len(a.validation) >= 1
    assert len(a.train) + len(a.validation) == 80
    assert not {tuple(d) for d in texts_of(a.train)} & {tuple(d) for d in texts_of(a.validation)}


def test_the_cache_follows_the_data_file(tmp_path, cache):
    path = write_text(tmp_path / "n.txt", n=20)
    wl = get_workload(user_workload_name(data="n.txt"))
    assert len(wl.load_data().train) + len(wl.load_data().validation) == 20
    assert len(list((cache / "user").iterdir())) == 1  # the second load hit the cache
    write_text(path, n=25)
    data = wl.load_data()
    assert len(data.train) + len(data.validation) == 25
    assert not list((cache / "user").glob(".*"))  # no temp folders left behind


# --- names ----------------------------------------------------------------------------------------


def test_the_name_round_trips_odd_paths_and_makes_them_absolute(tmp_path):
    name = user_workload_name("pkg.mod:build", "we;ird=dir/c.jsonl", str(tmp_path / "t%k"), text_field="body")
    spec = parse_user_name(name)
    assert spec.model == "pkg.mod:build" and spec.text_field == "body"
    assert spec.data == str(tmp_path / "we;ird=dir" / "c.jsonl") and spec.tokenizer == str(tmp_path / "t%k")
    assert "/" not in workload_slug(name) and workload_slug(name) == workload_slug(name)


@pytest.mark.parametrize("command", ["train", "data", "bench", "optimize", "profile", "tune", "lr-find"])
def test_every_training_command_takes_the_same_workload_flags(command):
    args = build_parser().parse_args([command, "--model", "m:build", "--data", "d.txt", "--tokenizer", "t"])
    resolve_workload(args)
    assert args.workload.startswith("user:") and args.size == CUSTOM_SIZE
    again = build_parser().parse_args([command, *workload_flags(args.workload, args.size).split()])
    resolve_workload(again)  # the command optimize prints selects the same workload
    assert (again.workload, again.size) == (args.workload, args.size)
    default = build_parser().parse_args([command])
    resolve_workload(default)
    assert (default.workload, default.size) == ("gpt-stdlib", "tiny")


def test_a_user_workload_name_works_in_a_subprocess_started_elsewhere(tmp_path, cache):
    write_text(tmp_path / "n.txt", n=20)
    name = user_workload_name(data="n.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "data", "--workload", name, "--max-len", "64"],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    docs = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines() if " docs " in line}
    assert docs["train"] + docs["validation"] == 20


# --- models ---------------------------------------------------------------------------------------


def test_a_factory_model_is_built_and_its_size_is_custom(tmp_path, tok_dir):
    mod = write_module(tmp_path, GPT2_FACTORY.format(vocab=320))
    write_text(tmp_path / "n.txt")
    wl = get_workload(user_workload_name(f"{mod}:build", "n.txt", str(tok_dir)))
    assert wl.sizes == (CUSTOM_SIZE,)
    model = wl.model(CUSTOM_SIZE, 64)
    assert type(model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(RecipeError, match="shapes.max_len=64"):
        wl.model(CUSTOM_SIZE, 128)  # 64 positions cannot take rows of 128


def test_without_model_the_builtin_gpt_is_sized_to_the_tokenizer(tmp_path, tok_dir):
    write_text(tmp_path / "n.txt")
    wl = get_workload(user_workload_name(data="n.txt", tokenizer=str(tok_dir)))
    assert "small" in wl.sizes
    vocab = wl.model("tiny", 64).config.vocab_size
    assert vocab % 64 == 0 and vocab >= load_tokenizer(str(tok_dir)).id_limit
    assert wl.load_data().vocab_size == vocab


# --- one-line errors with the fix -----------------------------------------------------------------


def run_cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "body, factory, message",
    [
        (None, "no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        ("def other():\n    pass\n", "build", "has no callable 'build'; it defines: other"),
        ("def build():\n    return 3\n", "build", "returned int, not a torch.nn.Module"),
        ("def build(n):\n    pass\n", "build", "must take no arguments"),
        ("import no_such_dep_xyz\n", "build", "cannot import"),
        ("raise ValueError('broken')\n", "build", "raised ValueError: broken"),
        (GPT2_FACTORY.format(vocab=100), "build", "the model embeds 100 token ids"),
    ],
)
def test_bad_models_fail_in_one_line(tmp_path, capsys, tok_dir, body, factory, message):
    write_text(tmp_path / "n.txt")
    spec = factory if body is None else f"{write_module(tmp_path, body)}:{factory}"
    err = run_cli(
        capsys, "train", "--model", spec, "--data", "n.txt", "--tokenizer", str(tok_dir), "--steps", "1"
    )
    assert message in err


@pytest.mark.parametrize(
    "content, argv, message",
    [
        (None, [], "no such file or folder"),
        (b"", [], "no documents found"),
        (b"one document only", [], "holds 1 document"),
        (b"text\x00\x01\x02binary", [], "is not UTF-8 text"),
        (b"\xff\xfe\x00broken", [], "is not UTF-8 text"),
        (b'{"body": "x"}\n', ["--text-field", "text"], "has no field 'text' (has: body); pass --text-field"),
        (b"not json\n", [], "is not JSON"),
    ],
)
def test_bad_data_fails_in_one_line(tmp_path, capsys, content, argv, message):
    path = tmp_path / ("d.jsonl" if b"{" in (content or b"") or content == b"not json\n" else "d.txt")
    if content is not None:
        path.write_bytes(content)
    assert message in run_cli(capsys, "data", "--data", str(path), *argv)


def test_a_folder_that_is_not_a_tokenizer_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "nottok").mkdir()
    (tmp_path / "nottok" / "readme.txt").write_text("hi")
    write_text(tmp_path / "n.txt")
    err = run_cli(capsys, "data", "--data", "n.txt", "--tokenizer", "nottok")
    assert "is not a tokenizer folder" in err and "save_pretrained" in err
    (tmp_path / "nottok" / "tokenizer.json").write_text("{}")
    assert "is not a tokenizer" in run_cli(capsys, "data", "--data", "n.txt", "--tokenizer", "nottok")


def test_conflicting_workload_flags_fail_in_one_line(tmp_path, capsys):
    write_text(tmp_path / "n.txt")
    assert "drop it" in run_cli(capsys, "data", "--workload", "vision-synthetic", "--data", "n.txt")
    assert "your --model decides" in run_cli(capsys, "train", "--model", "m:b", "--size", "small")
    assert "module:factory" in run_cli(capsys, "train", "--model", "just_a_module")
    assert "--tokenizer needs --data" in run_cli(capsys, "data", "--tokenizer", str(tmp_path))


def test_the_hash_split_never_leaves_a_side_empty():
    from slipstream.workloads.user_data import split_validation

    for n in (2, 3, 7):
        is_val = split_validation([f"doc {i}" for i in range(n)])
        assert is_val.any() and not is_val.all()
    assert np.array_equal(split_validation(["a", "b", "c"]), split_validation(["a", "b", "c"]))
