"""The bad-input catalogue, command line: every case exits 2 with one line on stderr that names the
problem and the fix, no traceback, and leaves the user's files byte-identical.

Cases run in-process through `slipstream.cli.main` (the same code path as the console script, minus
the interpreter start); `test_exit_path_in_a_real_process` runs a few through `python -m` to pin
the real exit status and stderr.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _bad_input import FAST, Case, assert_unchanged, check_message, snapshot

from slipstream.cli import main

TRAIN = f"train --recipe {FAST} --steps 2 --eval-every 0 --no-progress"
RESUME = "train --steps 3 --eval-every 0 --no-progress --resume --checkpoint-dir"

CASES = [
    # --- recipe files and overrides --------------------------------------------------------------
    Case(
        "recipe-malformed-toml", "train --recipe {bad}/malformed.toml", ("not valid TOML", "line 1", "fix it")
    ),
    Case("recipe-malformed-json", "train --recipe {bad}/malformed.json", ("not valid JSON", "fix it")),
    Case(
        "recipe-unknown-section", "train --recipe {bad}/unknown_section.toml", ("'nosuch'", "known: compile")
    ),
    Case("recipe-unknown-field", "train --recipe {bad}/unknown_field.toml", ("shapes.max_lenn", "max_len")),
    Case("recipe-wrong-type", "train --recipe {bad}/wrong_type.toml", ("shapes.max_len='long'", "integer")),
    Case(
        "recipe-out-of-range",
        "train --recipe {bad}/out_of_range.toml",
        ("shapes.max_len=-5", "between 2 and"),
    ),
    Case("recipe-nan", "train --recipe {bad}/nan.toml", ("optimizer.lr=nan", "finite number")),
    Case("recipe-not-a-table", "train --recipe {bad}/list.json", ("table/object of sections",)),
    Case("recipe-binary", "train --recipe {bad}/binary.toml", ("not valid TOML", "--save FILE")),
    Case(
        "recipe-deeply-nested-json", "train --recipe {bad}/deep.json", ("not valid JSON", "nesting too deep")
    ),
    Case("recipe-is-a-folder", "train --recipe {bad}/empty_dir", ("is a folder", ".toml or .json")),
    Case("recipe-wrong-suffix", "recipe {bad}/recipe.yaml", ("must end in .toml or .json",)),
    Case("recipe-missing", "train --recipe {bad}/nosuch.toml", ("does not exist",)),
    Case("recipe-unknown-preset", "train --recipe nosuch", ("unknown preset 'nosuch'", "available: auto")),
    Case("recipe-no-base", "recipe +shapes.max_len=5", ("names no preset", "baseline+shapes.max_len")),
    Case("set-without-equals", "train --set justwords", ("section.field=value",)),
    Case("set-unknown-section", "train --set nosection.x=1", ("'nosection'", "known: compile")),
    Case("set-bad-choice", "train --set precision.dtype=fp64", ("'fp64'", "choose one of 'fp32'")),
    Case("set-inf", "train --set optimizer.lr=inf", ("optimizer.lr=inf", "finite number")),
    Case(
        "set-tokens-below-a-row",
        f"{TRAIN} --set shapes.tokens_per_batch=16",
        ("tokens_per_batch=16", "at least 64"),
    ),
    Case(
        "set-cuda-without-cuda",
        "train --set runtime.device=cuda",
        ("no CUDA device", "runtime.device=auto or cpu"),
    ),
    Case(
        "save-keeps-existing-recipe",
        "recipe baseline+shapes.max_len=abc --save {bad}/existing.toml",
        ("shapes.max_len='abc'", "integer"),
        keep=("{bad}/existing.toml",),
    ),
    Case(
        "save-wrong-suffix",
        "recipe baseline --save {bad}/recipe.yaml",
        ("must end in .toml or .json",),
        keep=("{bad}/recipe.yaml",),
    ),
    # --- data ----------------------------------------------------------------------------------
    Case("data-empty-file", "train --data {bad}/empty.txt", ("no documents found", "give it some text")),
    Case("data-binary", "train --data {bad}/binary.dat", ("not UTF-8 text", "pass text, .jsonl")),
    Case("data-not-utf8", "train --data {bad}/latin1.txt", ("not UTF-8 text", "byte 3")),
    Case("data-one-huge-line", "train --data {bad}/one_line.txt", ("holds 1 document", "blank line")),
    Case(
        "data-all-too-long-drop",
        f"{TRAIN} --data {{bad}}/too_long.jsonl --set shapes.overflow=drop",
        ("dropped all", "raise max_len or use overflow=split"),
    ),
    Case(
        "data-all-too-long-error",
        f"{TRAIN} --data {{bad}}/too_long.jsonl --set shapes.overflow=error",
        ("sequences are longer than shapes.max_len=64", "set shapes.overflow=truncate"),
    ),
    Case("data-missing", "train --data {bad}/nosuch.txt", ("no such file or folder",)),
    Case("data-empty-folder", "train --data {bad}/empty_dir", ("no documents found",)),
    Case(
        "data-jsonl-no-field", "train --data {bad}/no_field.jsonl", ("no field 'text'", "--text-field NAME")
    ),
    Case(
        "data-jsonl-not-json",
        "train --data {bad}/not_json.jsonl",
        ("line 2 is not JSON", "one object per line"),
    ),
    Case("data-cmd-binary", "data --data {bad}/binary.dat", ("not UTF-8 text",)),
    Case("data-cmd-max-len-0", "data --max-len 0", ("--max-len 0", "at least 2")),
    # --- tokenizers ------------------------------------------------------------------------------
    Case(
        "tokenizer-missing",
        "train --data {bad}/latin1.txt --tokenizer {bad}/nosuch_tok",
        ("no such folder", "save_pretrained"),
    ),
    Case(
        "tokenizer-garbage",
        "train --data {bad}/too_long.jsonl --tokenizer {bad}/garbage_tok",
        ("is not a tokenizer", "save_pretrained"),
    ),
    Case(
        "tokenizer-not-a-tokenizer-folder",
        "train --data {bad}/too_long.jsonl --tokenizer {bad}/empty_dir",
        ("not a tokenizer folder", "save_pretrained"),
    ),
    Case("tokenizer-without-data", "train --tokenizer {bad}/garbage_tok", ("--tokenizer needs --data",)),
    # --- checkpoints ---------------------------------------------------------------------------
    Case(
        "checkpoint-truncated",
        f"{RESUME} {{bad}}/truncated --recipe {FAST}",
        ("is damaged", "restore it from a backup"),
        keep=("{bad}/truncated/checkpoint.pt",),
    ),
    Case(
        "checkpoint-not-a-checkpoint",
        f"{RESUME} {{bad}}/not_ckpt --recipe {FAST}",
        ("not a slipstream checkpoint",),
        keep=("{bad}/not_ckpt/checkpoint.pt",),
    ),
    Case(
        "checkpoint-json",
        f"{RESUME} {{bad}}/json_ckpt --recipe {FAST}",
        ("not a slipstream checkpoint",),
        keep=("{bad}/json_ckpt/checkpoint.pt",),
    ),
    Case(
        "checkpoint-other-recipe",
        f"{RESUME} {{ck}} --recipe {FAST}+shapes.max_len=32",
        ("different run", "shapes.max_len: checkpoint 64, now 32", "use a new --checkpoint-dir"),
        keep=("{ck}/checkpoint.pt",),
    ),
    Case(
        "checkpoint-other-model",
        f"{RESUME} {{ck}} --recipe {FAST} --size small",
        ("different run", "size: checkpoint 'tiny', now 'small'"),
        keep=("{ck}/checkpoint.pt",),
    ),
    Case(
        "checkpoint-other-workload",
        f"{RESUME} {{ck}} --recipe {FAST} --workload vision-synthetic",
        ("different run", "workload: checkpoint 'gpt-stdlib'"),
        keep=("{ck}/checkpoint.pt",),
    ),
    Case(
        "checkpoint-exists-without-resume",
        f"{TRAIN} --checkpoint-dir {{ck}}",
        ("already exists", "pass --resume"),
        keep=("{ck}/checkpoint.pt",),
    ),
    Case("resume-without-folder", "train --resume", ("pass --checkpoint-dir",)),
    Case("resume-empty-folder", "train --resume --checkpoint-dir {bad}/empty_dir", ("no checkpoint at",)),
    Case(
        "serve-checkpoint-truncated",
        "serve --port 0 --checkpoint {bad}/truncated/checkpoint.pt",
        ("is damaged",),
        keep=("{bad}/truncated/checkpoint.pt",),
    ),
    Case(
        "serve-checkpoint-missing",
        "serve --port 0 --checkpoint {bad}/nosuch.pt",
        ("does not exist", "checkpoint.pt"),
    ),
    Case(
        "quantize-eval-not-a-checkpoint",
        "quantize-eval --checkpoint {bad}/not_ckpt --modes none",
        ("damaged",),
    ),
    # --- output files --------------------------------------------------------------------------
    Case(
        "json-is-a-folder",
        f"{TRAIN} --json {{bad}}/empty_dir",
        ("--json", "is a folder", "give a file path"),
    ),
    Case("json-under-a-file", f"{TRAIN} --json {{bad}}/a_file/out.json", ("is a file, not a folder",)),
    Case(
        "json-kept-when-recipe-bad",
        "train --recipe {bad}/malformed.toml --json {bad}/existing.json",
        ("not valid TOML",),
        keep=("{bad}/existing.json",),
    ),
    Case(
        "export-onto-a-file",
        f"{TRAIN} --export {{bad}}/a_file",
        ("not an earlier export", "choose an empty or new folder"),
        keep=("{bad}/a_file",),
    ),
    # --- flags of each command -----------------------------------------------------------------
    Case("train-steps-0", "train --steps 0", ("steps=0", "at least 1")),
    Case("train-eval-every-negative", "train --eval-every -1", ("eval_every=-1", "0 = never")),
    Case("train-eval-batches-0", "train --eval-batches 0", ("eval_batches=0", "eval_every=0")),
    Case("train-steps-not-a-number", "train --steps abc", ("invalid int value: 'abc'",), usage=True),
    Case("train-unknown-workload", "train --workload nosuch", ("unknown workload", "available: gpt-stdlib")),
    Case("train-unknown-size", "train --size huge", ("no size 'huge'", "choose one of tiny")),
    Case("train-model-no-colon", "train --model nocolon", ("give module:factory",)),
    Case("train-model-not-importable", "train --model nosuchmod:build", ("cannot import 'nosuchmod'",)),
    Case("train-nproc-0", "train --nproc 0", ("--nproc must be >= 1",)),
    Case("bench-rounds-0", "bench --rounds 0", ("rounds=0", "at least 1")),
    Case("bench-no-recipes", "bench --recipes ,", ("names no recipe", "--recipes baseline")),
    Case(
        "bench-unknown-peer", "bench --peers nosuch", ("unknown peer 'nosuch'", "available: accelerate, diy")
    ),
    Case("bench-negative-warmup", "bench --warmup-steps -1", ("--warmup-steps -1", ">= 0")),
    Case("bench-negative-parity-steps", "bench --parity-steps -5", ("--parity-steps -5", ">= 0")),
    Case("bench-val-batches-0", "bench --val-batches 0", ("--val-batches 0", ">= 1")),
    Case(
        "tune-bad-range",
        "tune --param lr=1:0 --json {bad}/existing.json",
        ("LOW must be below HIGH",),
        keep=("{bad}/existing.json",),
    ),
    Case("tune-trials-0", "tune --trials 0", ("--trials 0", "at least 1")),
    Case("tune-unknown-objective", "tune --objective nosuch", ("'nosuch'", "choose one of branin")),
    Case("tune-unknown-param", "tune --param nosuch=1:2", ("not a recipe field", "recipe --fields")),
    Case("lr-find-start-lr-0", "lr-find --start-lr 0", ("0 < start_lr < end_lr",)),
    Case("optimize-bad-budget", "optimize --budget abc", ("--budget 'abc'", "5m")),
    Case(
        "optimize-unknown-stage", "optimize --stages nosuch", ("unknown optimize stage", "choose from shapes")
    ),
    Case("profile-active-0", "profile --active 0", ("active=0", "at least 1")),
    Case(
        "profile-option-after-dashes",
        "profile -- --weird",
        ("unknown option '--weird'", "-- python script.py"),
    ),
    Case("profile-missing-script", "profile -- python {bad}/nosuch.py", ("not found", "path/to/script.py")),
    Case(
        "quantize-eval-unknown-mode",
        "quantize-eval --modes nosuch",
        ("unknown ['nosuch']", "choose from none"),
    ),
    Case("quantize-eval-reps-0", "quantize-eval --modes none --reps 0", ("--reps 0", "at least 1")),
    Case(
        "serve-port-out-of-range", "serve --size tiny --port 70000", ("--port 70000", "between 0 and 65535")
    ),
    Case("serve-port-in-use", "serve --size tiny --port {busy}", ("cannot be used", "pick another --port")),
    Case("serve-max-queue-0", "serve --size tiny --port 0 --max-queue 0", ("--max-queue 0", "> 0")),
    Case(
        "serve-negative-slots",
        "serve --size tiny --port 0 --generate-slots -1",
        ("--generate-slots -1", ">= 0"),
    ),
    Case(
        "serve-unknown-quantize",
        "serve --size tiny --port 0 --quantize nosuch",
        ("'nosuch'", "choose one of none"),
    ),
    Case(
        "serve-model-not-a-folder",
        "serve --port 0 --model {bad}/empty_dir",
        ("no config.json", "save_pretrained"),
    ),
    Case("loadtest-rate-0", "loadtest --rate 0 --duration 1", ("--rate 0", "must be > 0")),
    Case(
        "loadtest-no-server",
        "loadtest --url http://127.0.0.1:{free}/v1/score --rate 1",
        ("nothing answers", "slipstream serve"),
    ),
    Case(
        "loadtest-remote-url", "loadtest --url http://example.com/v1/score --rate 1", ("only this machine",)
    ),
    Case(
        "loadtest-binary-prompts",
        "loadtest --endpoint completions --model-name m --rate 1 --prompts {bad}/binary.dat",
        ("not UTF-8 text", ".jsonl"),
    ),
]


def _free_port() -> int:
    """A port nothing listens on (bound for a moment by us, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fill(text: str, bad: Path, ck: Path, busy: int) -> str:
    if "{free}" not in text:
        return text.format(bad=bad, ck=ck, busy=busy)
    return text.format(bad=bad, ck=ck, busy=busy, free=_free_port())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_with_one_line_naming_the_fix(
    case, bad, ck, busy_port, capsys, monkeypatch, tmp_path
):
    if case.id == "set-cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("this host has CUDA: runtime.device=cuda is valid here")
    argv = shlex.split(_fill(case.argv, bad, ck, busy_port))
    monkeypatch.chdir(tmp_path)  # a command that wrongly writes to the working folder writes here
    if "--data" in argv:
        monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))  # the user-corpus cache
    before = snapshot([Path(_fill(k, bad, ck, busy_port)) for k in case.keep])
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2, err
    check_message(err, argv[0], case.needles, usage=case.usage)
    assert_unchanged(before)
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "cache"]), "wrote into the working folder"


def test_the_catalogue_is_broad():
    """At least 40 command-line cases, across every command the issue names."""
    assert len(CASES) >= 40
    commands = {c.argv.split()[0] for c in CASES}
    assert {"train", "bench", "data", "recipe", "tune", "optimize", "profile", "serve"} <= commands
    assert len({c.id for c in CASES}) == len(CASES)


EXIT_PATH = [
    Case(
        "real-process-bad-recipe-keeps-json",
        "slipstream train --recipe {bad}/malformed.toml --json {bad}/existing.json",
        ("not valid TOML", "fix it"),
        keep=("{bad}/existing.json",),
    ),
    Case("real-process-argparse", "slipstream train --steps abc", ("invalid int value",), usage=True),
    Case(
        "real-process-serve-entry",
        "slipstream.serve.cli serve --size tiny --port 70000",
        ("between 0 and 65535",),
    ),
]


@pytest.mark.parametrize("case", EXIT_PATH, ids=[c.id for c in EXIT_PATH])
def test_exit_path_in_a_real_process(case, bad, ck, busy_port, tmp_path):
    module, *argv = shlex.split(_fill(case.argv, bad, ck, busy_port))
    before = snapshot([Path(_fill(k, bad, ck, busy_port)) for k in case.keep])
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    check_message(proc.stderr, argv[0], case.needles, usage=case.usage)
    assert_unchanged(before)
