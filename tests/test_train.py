"""The built-in loop: learning, refused checkpoints, bad input. Exact resume after kill -9 at seeded
points (mid checkpoint write too) and full disks: tests/reliability/test_kill.py, test_disk_full.py."""

import os
import subprocess
import sys

import pytest

from slipstream import train
from slipstream.checkpoint import CheckpointError
from slipstream.recipe import RecipeError

# Small rows keep this fast on 2 cores; deterministic algorithms for bit-exact comparisons, and one
# optimizer kernel: two separate runs timing `auto` on a loaded machine may pick different ones.
FAST = (
    "baseline+shapes.max_len=64+shapes.tokens_per_batch=256+runtime.deterministic=true+optimizer.impl=foreach"
)


def run_cli(*args, check=True):
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_training_lowers_validation_loss():
    result = train("gpt-stdlib", FAST, steps=30, eval_every=30, eval_batches=4, progress=False)
    first, last = result.val_loss[0]["loss"], result.val_loss[-1]["loss"]
    assert last < 0.8 * first
    assert len(result.loss) == 30 and result.metrics.real_tokens > 0
    assert 0.0 <= result.metrics.padding_waste < 1.0
    import torch

    assert not torch.are_deterministic_algorithms_enabled()  # the run put it back when it ended


def test_mismatched_or_corrupt_checkpoint_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    train("gpt-stdlib", FAST, steps=2, eval_every=0, checkpoint_dir=run_dir, progress=False)
    ckpt = run_dir / "checkpoint.pt"
    before = ckpt.read_bytes()
    with pytest.raises(CheckpointError, match="different run.*optimizer.lr"):
        train("gpt-stdlib", FAST + "+optimizer.lr=0.01", steps=4, checkpoint_dir=run_dir, resume=True)
    with pytest.raises(CheckpointError, match="already exists; pass --resume"):
        train("gpt-stdlib", FAST, steps=4, checkpoint_dir=run_dir, progress=False)
    assert ckpt.read_bytes() == before  # nothing overwritten
    ckpt.write_bytes(before[: len(before) // 3])
    with pytest.raises(CheckpointError, match="damaged"):
        train("gpt-stdlib", FAST, steps=4, checkpoint_dir=run_dir, resume=True)


def test_unknown_names_fail_clearly():
    with pytest.raises(RecipeError, match="unknown workload 'gpt-x'"):
        train("gpt-x", "baseline", steps=1)
    with pytest.raises(RecipeError, match="has no size 'huge'"):
        train("gpt-stdlib", "baseline", steps=1, size="huge")


def test_cli_bad_input_exits_nonzero_with_one_line(tmp_path):
    proc = run_cli("train", "--recipe", "nope", "--steps", "1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown preset 'nope'" in proc.stderr
    proc = run_cli("train", "--set", "precision.dtype=fp64", "--steps", "1", check=False)
    assert proc.returncode == 2 and "precision.dtype='fp64'" in proc.stderr
