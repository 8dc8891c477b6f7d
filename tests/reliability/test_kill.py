"""SIGKILL from outside at seeded random points, then the same command again.

- `train`: one uninterrupted reference run, then 10 runs killed at seeded points, each anchored to
  something the test sees happen in the checkpoint folder (inotify): a checkpoint's temp file just
  created (the kill lands inside torch.save), its temp just closed (between fsync and rename), the
  new checkpoint just renamed into place, a random fraction of a checkpoint interval later (mid
  steps), or a random delay after start. Each resume must give per-step losses bit-identical to
  the reference, resume from the checkpoint the kill point implies, and leave no temp file.
- `tune`: killed mid-study (as a seeded trial is reported) and again while writing its outputs; the same command resumes the
  study (finished trials kept, the killed one failed by its heartbeat) and the SQLite study, the
  JSON, the recipe and the plots are never torn.
- `optimize`: killed mid-search (at a seeded line of its progress log) and again while writing its outputs; the same command runs again
  to a complete, parseable set of outputs.

No fault hook in slipstream is used: the faults come from this test (see _faults.py).
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import sys
import time

import pytest
import torch
from _faults import INOTIFY, Child, FolderWatch, temp_files

from slipstream.recipe import load_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not INOTIFY, reason="kill points are found with Linux inotify"),
]

# Small rows, deterministic kernels, one optimizer kernel (auto's timing may pick differently per run).
FAST = (
    "baseline+shapes.max_len=64+shapes.tokens_per_batch=256+runtime.deterministic=true+optimizer.impl=foreach"
)
STEPS, EVERY = 12, 2  # checkpoint writes at steps 2, 4, ..., 12 (and once more at the end)
TRAIN = ["train", "--recipe", FAST, "--steps", STEPS, "--eval-every", "0", "--no-progress"]
TEMP = r"\.checkpoint\.pt\..*\.tmp"


def _kill_plan(seed: int = 16) -> list[tuple[str, int, float]]:
    """(kind, k, fraction) for 10 kills; k: which checkpoint write (1..5) the kill is anchored to."""
    rng = random.Random(seed)
    plan = [("start", 0, round(rng.random(), 3))]
    # in the first write (no good checkpoint yet: a fresh restart), and in two later ones
    plan += [("in-write", k, 0.0) for k in [1, *sorted(rng.sample(range(2, 6), 2))]]
    plan += [("before-rename", rng.randint(1, 5), 0.0), ("after-rename", rng.randint(1, 5), 0.0)]
    plan += [("mid-steps", rng.randint(2, 5), round(rng.random(), 3)) for _ in range(4)]
    return plan


PLAN = _kill_plan()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    child = Child([*TRAIN, "--json", folder / "straight.json"], folder, folder / "log.txt")
    assert child.wait() == 0, child.output()
    losses = json.loads((folder / "straight.json").read_text())["loss"]
    assert len(losses) == STEPS
    return losses


def _checkpoint_step(run_dir) -> int | None:
    path = run_dir / "checkpoint.pt"
    if not path.exists():
        return None
    return int(torch.load(path, map_location="cpu", weights_only=True)["step"])


@pytest.mark.parametrize(
    ("kind", "k", "fraction"), PLAN, ids=[f"{i}-{p[0]}-{p[1]}" for i, p in enumerate(PLAN)]
)
def test_train_killed_at_a_seeded_point_resumes_exactly(tmp_path, reference, kind, k, fraction):
    run_dir = tmp_path / "run"
    watch = FolderWatch(run_dir)
    args = [*TRAIN, "--checkpoint-dir", run_dir, "--checkpoint-every", EVERY]
    child = Child(args, tmp_path, tmp_path / "killed.txt")
    try:
        if kind == "start":
            time.sleep(0.2 + 2.5 * fraction)  # anywhere from imports to the first checkpoints
        elif kind == "in-write":
            assert watch.wait_for("created", TEMP, k, child), child.output()
        elif kind == "before-rename":
            assert watch.wait_for("closed", TEMP, k, child), child.output()
        elif kind == "after-rename":
            assert watch.wait_for("renamed", "checkpoint.pt", k, child), child.output()
        else:  # mid-steps: a random fraction of the last checkpoint interval after checkpoint k
            t_k = watch.wait_for("renamed", "checkpoint.pt", k, child)
            assert t_k, child.output()
            time.sleep(fraction * (t_k - watch.matching("renamed", "checkpoint.pt")[k - 2][2]))
        assert child.alive(), "the run finished before the kill point: " + child.output()
    finally:
        rc = child.kill()
        watch.close()
    assert rc == -9
    saved = _checkpoint_step(run_dir)  # the file on disk is always whole: torch.load reads it
    left = temp_files(run_dir)
    if kind == "in-write":  # killed inside torch.save: the temp is there, the last good one stays
        assert left and saved == (2 * (k - 1) or None)
    elif kind == "before-rename":  # the rename may just have happened: either good checkpoint
        assert saved in (2 * (k - 1) or None, 2 * k)
    elif kind in ("after-rename", "mid-steps"):
        assert saved is not None and saved >= 2 * k

    resumed = tmp_path / "resumed.json"
    again = [*args, "--json", resumed] + (["--resume"] if saved is not None else [])
    child = Child(again, tmp_path, tmp_path / "resumed.txt")
    assert child.wait() == 0, child.output()
    out = json.loads(resumed.read_text())
    assert out.get("resumed_from_step") == saved
    assert out["loss"] == reference  # bit-identical per-step losses, all 12
    assert temp_files(run_dir) == []  # a torn temp is removed on the next start


# ----------------------------------------------------------------------------- tune

TUNE = [
    "tune", "--recipe", "baseline+shapes.max_len=64+shapes.tokens_per_batch=256",
    "--param", "lr=1e-4:3e-2:log", "--param", "warmup=0:4", "--trials", "3", "--steps", "4",
    "--eval-every", "2", "--eval-batches", "1", "--seed", "0", "--heartbeat", "1",
]  # fmt: skip
TUNE_OUT = r"\.(result\.json|best\.toml|history\.png|importance\.png|out\.json)\..*\.tmp"


def _db_ok(db) -> None:
    conn = sqlite3.connect(db)  # opening rolls back a killed transaction, as Optuna's would
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


def _outputs_whole(folder) -> None:
    """Every output present is complete: JSON parses, the recipe loads, a PNG has its end chunk."""
    for name in ("result.json", "out.json", "report.json"):
        if (folder / name).exists():
            json.loads((folder / name).read_text())
    for name in ("best.toml", "recipe.toml"):
        if (folder / name).exists():
            load_recipe(folder / name)
    for png in folder.glob("*.png"):
        assert png.read_bytes().endswith(b"IEND\xaeB`\x82"), png
    for md in folder.glob("*.md"):
        assert md.read_text().endswith("\n"), md
    for page in folder.glob("*.html"):
        assert page.read_text().rstrip().endswith("</table>"), page


def test_tune_killed_mid_study_and_mid_write_resumes(tmp_path):
    rng = random.Random(161)
    run_dir = tmp_path / "run"
    args = [*TUNE, "--run-dir", run_dir, "--json", run_dir / "out.json"]
    watch = FolderWatch(run_dir)

    # 1. mid-study: as a seeded trial (0 or 1) is reported, so the kill lands in the next one or
    # between the two (a seeded delay after the database appeared once landed after the last trial)
    child = Child(args, tmp_path, tmp_path / "1.txt")
    try:
        assert watch.wait_for("created", "study.db", 1, child), child.output()
        assert child.wait_for_output(rf"^trial +{rng.randint(0, 1)} "), child.output()
        assert child.alive(), child.output()
    finally:
        assert child.kill() == -9
    _db_ok(run_dir / "study.db")
    _outputs_whole(run_dir)

    # 2. the same command again, killed as it starts one of its output writes (seeded choice)
    target = rng.choice(["result", "best", "history", "out"])
    child = Child(args, tmp_path, tmp_path / "2.txt")
    try:
        assert watch.wait_for("created", rf"\.{target}\..*\.tmp", 1, child), child.output()
    finally:
        assert child.kill() == -9
    _db_ok(run_dir / "study.db")
    _outputs_whole(run_dir)

    # 3. and again: the study is complete, every output whole, no temp left
    child = Child(args, tmp_path, tmp_path / "3.txt")
    assert child.wait() == 0, child.output()
    _outputs_whole(run_dir)
    assert temp_files(run_dir) == []
    summary = json.loads((run_dir / "result.json").read_text())
    states = summary["states"]
    assert states["COMPLETE"] + states["PRUNED"] >= 3 and states["RUNNING"] == 0
    # the trial the first kill interrupted: FAILED by its heartbeat, then run again with its params;
    # one killed before it drew any (Optuna creates the trial, then the sampler draws) has none to
    # keep, and its re-run draws fresh ones (CI once landed the kill there)
    failed = [t for t in summary["trials"] if t["state"] == "FAIL"]
    assert len(failed) <= 1
    for t in failed:
        if t["params"]:
            assert any(r["params"] == t["params"] and r["state"] != "FAIL" for r in summary["trials"])
    assert summary["base"] is not None  # the base recipe's trial is never lost to a kill
    assert json.loads((run_dir / "out.json").read_text()) == summary
    assert (run_dir / "history.png").exists() and (run_dir / "best.toml").exists()
    watch.close()


# ----------------------------------------------------------------------------- optimize

OPTIMIZE = [
    "optimize", "--size", "tiny", "--budget", "5m", "--stages", "shapes",
    "--base", "baseline+shapes.max_len=64+shapes.tokens_per_batch=256",
    "--rounds", "1", "--round-tokens", "256", "--noise-seeds", "1",
]  # fmt: skip


def test_optimize_killed_mid_search_and_mid_write_runs_again(tmp_path):
    rng = random.Random(162)
    out = tmp_path / "opt"
    args = [*OPTIMIZE, "--out", out]
    watch = FolderWatch(out)

    # 1. mid-search: as it reaches a seeded point of its progress log (a seeded delay after start
    # once landed after the whole 3 s search on an idle host); nothing is written before the end
    child = Child(args, tmp_path, tmp_path / "1.txt")
    try:
        point = rng.choice(["stage reference", "] warm-up", "] round 1/", "stage shapes", "batching check"])
        assert child.wait_for_output(re.escape(point)), child.output()
        assert child.alive(), child.output()
    finally:
        assert child.kill() == -9
    assert list(out.iterdir()) == []

    # 2. again, killed as it starts writing one of its outputs (seeded choice)
    target = rng.choice(["recipe.toml", "report.json", "report.md", "report.html"])
    child = Child(args, tmp_path, tmp_path / "2.txt")
    try:
        assert watch.wait_for("created", rf"\.{target}\..*\.tmp", 1, child), child.output()
    finally:
        assert child.kill() == -9
    _outputs_whole(out)

    # 3. and again: the whole set, complete, no temp left
    child = Child(args, tmp_path, tmp_path / "3.txt")
    assert child.wait() == 0, child.output()
    assert sorted(p.name for p in out.iterdir()) == ["recipe.toml", "report.html", "report.json", "report.md"]
    _outputs_whole(out)
    report = json.loads((out / "report.json").read_text())
    assert load_recipe(out / "recipe.toml").to_dict()["shapes"] == report["best_recipe"]["shapes"]
    watch.close()


if __name__ == "__main__":  # the kill plan, for the docs
    print("\n".join(f"{i}: {p}" for i, p in enumerate(PLAN)), file=sys.stderr)
