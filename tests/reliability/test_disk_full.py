"""The disk fills up while slipstream writes a checkpoint, a recipe or a report.

Two ways to fill it: RLIMIT_FSIZE in the child (any platform, no root: a write past the limit fails
with EFBIG), and, where the test may mount one (root on Linux), a real tmpfs too small for the new
file (ENOSPC). Each time: exit status 2, one line on stderr naming the file and the fix, the
previous file byte-identical, and no temp file left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _faults import child_env, file_size_limit, slipstream_argv, temp_files

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")]

FAST = (
    "baseline+shapes.max_len=64+shapes.tokens_per_batch=256+runtime.deterministic=true+optimizer.impl=foreach"
)
TRAIN = ["train", "--recipe", FAST, "--eval-every", "0", "--no-progress", "--checkpoint-every", "2"]


def run(args: list[object], cwd: Path, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        slipstream_argv(*args),
        cwd=cwd,
        capture_output=True,
        text=True,
        env=child_env(),
        preexec_fn=file_size_limit(limit) if limit else None,
        timeout=300,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], path: Path, before: bytes, why: str) -> None:
    """Exit 2, one line naming the file and the fix, the old file untouched, no temp left."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]  # progress lines (bench) may come before it
    assert err.startswith(f"slipstream {proc.args[3]}: error: "), proc.stderr
    assert f"no space left writing {'checkpoint ' if path.suffix == '.pt' else ''}{path} ({why})" in err, err
    assert "free space or choose another" in err, err
    assert path.read_bytes() == before
    assert temp_files(path.parent) == []


def test_checkpoint_write_past_the_file_size_limit(tmp_path):
    run_dir = tmp_path / "run"
    assert run([*TRAIN, "--steps", "2", "--checkpoint-dir", run_dir], tmp_path).returncode == 0
    ckpt = run_dir / "checkpoint.pt"
    before = ckpt.read_bytes()
    # resumed to 4 steps, the checkpoint at step 4 cannot be written: it stops there, saying so
    full = run([*TRAIN, "--steps", "4", "--checkpoint-dir", run_dir, "--resume"], tmp_path, limit=256 << 10)
    assert_refused(full, ckpt, before, "File too large")
    # space freed: the same command resumes from the kept checkpoint
    again = run(
        [*TRAIN, "--steps", "4", "--checkpoint-dir", run_dir, "--resume", "--json", "r.json"], tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert '"resumed_from_step": 2' in (tmp_path / "r.json").read_text()


def test_recipe_save_past_the_file_size_limit(tmp_path):
    saved = tmp_path / "my.toml"
    assert run(["recipe", "baseline", "--save", saved], tmp_path).returncode == 0
    before = saved.read_bytes()
    proc = run(["recipe", "baseline+precision.dtype=bf16", "--save", saved], tmp_path, limit=200)
    assert_refused(proc, saved, before, "File too large")


@pytest.mark.parametrize("kind", ["data --json", "bench --json --report"])
def test_report_write_past_the_file_size_limit(tmp_path, kind):
    if kind == "data --json":
        report, limit = tmp_path / "stats.json", 200
        args = ["data", "--max-len", "64", "--json", report]
        changed = ["data", "--max-len", "128", "--json", report]
    else:  # the JSON (a few KB) fits under the limit; the HTML report (~100 KB, a plot inside) does not
        report, limit = tmp_path / "bench.html", 48 << 10
        args = [
            "bench", "--size", "tiny", "--recipes", "baseline+shapes.max_len=64+shapes.tokens_per_batch=256",
            "--rounds", "1", "--round-tokens", "256", "--noise-seeds", "0", "--no-memory",
            "--warmup-steps", "0", "--val-batches", "1", "--json", tmp_path / "bench.json", "--report", report,
        ]  # fmt: skip
        changed = args
    first = run(args, tmp_path)
    assert first.returncode == 0, first.stderr
    before = report.read_bytes()
    assert len(before) > limit
    assert_refused(run(changed, tmp_path, limit=limit), report, before, "File too large")


# ----------------------------------------------------------------------------- a real full disk


@pytest.fixture
def small_fs(tmp_path):
    """mount(size_bytes) -> a fresh tmpfs of that size (root on Linux only); unmounted after."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root on Linux (RLIMIT_FSIZE covers the rest)")
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / f"small{len(mounted)}"
        point.mkdir()
        opts = f"size={size},mode=0755"
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True, timeout=60)


def test_checkpoint_and_recipe_on_a_full_filesystem(tmp_path, small_fs):
    run_dir = tmp_path / "run"
    assert run([*TRAIN, "--steps", "2", "--checkpoint-dir", run_dir], tmp_path).returncode == 0
    before = (run_dir / "checkpoint.pt").read_bytes()
    # room for the checkpoint and half of the next one
    disk = small_fs(len(before) * 3 // 2)
    shutil.copy(run_dir / "checkpoint.pt", disk / "checkpoint.pt")
    full = run([*TRAIN, "--steps", "4", "--checkpoint-dir", disk, "--resume"], tmp_path)
    assert_refused(full, disk / "checkpoint.pt", before, "No space left on device")

    disk = small_fs(64 << 10)
    saved = disk / "my.toml"
    assert run(["recipe", "baseline", "--save", saved], tmp_path).returncode == 0
    before = saved.read_bytes()
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:  # fill what is left
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    proc = run(["recipe", "baseline+precision.dtype=bf16", "--save", saved], tmp_path)
    assert_refused(proc, saved, before, "No space left on device")
