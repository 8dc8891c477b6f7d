"""Two real ranks under torchrun (gloo, one thread each): DDP and FSDP2 follow the one-process loop
on the same global batch, shapes stay in lock-step, DCP checkpoints reshard 2 -> 1 and 1 -> 2, and
a killed rank ends the run with a message instead of a hang; torchrun's restart resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Bucketed rows of different lengths, so micro-batches differ in targets and the token weighting
# is exercised; one optimizer kernel, so separate runs cannot time `auto` differently.
RECIPE = (
    'baseline+shapes.mode="bucket"+shapes.max_len=64+shapes.tokens_per_batch=512'
    '+optimizer.impl="foreach"+distributed.batches_per_step=2'
)
COMMON = ["train", "--eval-every", "0", "--no-progress"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def train(tmp: Path, name: str, *args: str, nproc: int = 1, recipe: str = RECIPE, check: bool = True):
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "slipstream", *COMMON, "--recipe", recipe, "--json", str(out), *args]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())
    return proc


def _close(a, b, rtol):
    assert len(a) == len(b)
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst <= rtol, f"relative difference {worst:.2e} > {rtol:g}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process accumulating each step's 2 batches, 8 steps: what every layout must reproduce."""
    return train(tmp_path_factory.mktemp("straight"), "straight", "--steps", "8")


def test_ddp_and_fsdp_follow_one_process_on_the_same_global_batch(tmp_path, straight):
    one = {"loss": straight["loss"][:6], "real_tokens": straight["real_tokens"] * 6 / 8}
    ddp = train(tmp_path, "ddp", "--steps", "6", nproc=2)
    fsdp = train(tmp_path, "fsdp", "--steps", "6", nproc=2, recipe=RECIPE + '+distributed.strategy="fsdp"')
    _close(ddp["loss"], one["loss"], 1e-6)
    _close(fsdp["loss"], one["loss"], 1e-5)
    assert ddp["world_size"] == 2 and ddp["distributed_strategy"] == "ddp"
    # each rank collated only its shard: half the real tokens of the one process
    assert ddp["real_tokens"] < 0.75 * one["real_tokens"]
    assert ddp["lockstep_mismatched_steps"] == 0


def test_a_rank_leaves_without_teardown_but_keeps_its_output_and_exit_code(tmp_path):
    # Under torchrun (TORCHELASTIC_RUN_ID) `python -m slipstream` ends with os._exit after the exit
    # handlers: what it printed, the files it wrote and its return code must all survive that.
    env = dict(_env(), TORCHELASTIC_RUN_ID="test")
    saved = tmp_path / "r.toml"
    ok = subprocess.run(
        [sys.executable, "-m", "slipstream", "recipe", "baseline", "--save", str(saved)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert f"wrote {saved}" in ok.stdout and 'name = "baseline"' in saved.read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "slipstream", "recipe", "no-such-preset"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown preset 'no-such-preset'" in bad.stderr


def test_ranks_run_one_shape_per_step_over_a_whole_epoch(tmp_path):
    from slipstream.distributed.shards import StepShards
    from slipstream.recipe import Recipe
    from slipstream.shapes.loader import ShapedLoader
    from slipstream.workloads import get_workload

    recipe = Recipe().override(
        'shapes.mode="bucket"', "shapes.max_len=64", "shapes.tokens_per_batch=4096"
    )  # big batches: an epoch is short
    data = get_workload("gpt-stdlib").load_data()
    loader = ShapedLoader(data.train, recipe.shapes, lengths=data.train_lengths, group=2)
    epoch = StepShards(loader, batches_per_step=2, rank=0, world_size=2).steps_per_epoch()
    spec = RECIPE.replace("tokens_per_batch=512", "tokens_per_batch=4096")
    out = train(tmp_path, "epoch", "--steps", str(epoch + 1), nproc=2, recipe=spec)
    assert out["distinct_shapes"] > 1  # several buckets were visited...
    assert out["lockstep_mismatched_steps"] == 0  # ...and every step ran one of them on both ranks


def test_dcp_checkpoints_resume_exactly_across_world_sizes(tmp_path, straight):
    straight = straight["loss"]
    # 2 ranks write a DCP checkpoint at step 4; one process continues it to step 8
    two = tmp_path / "two"
    train(tmp_path, "a", "--steps", "4", "--checkpoint-dir", str(two), nproc=2)
    assert (two / "checkpoint.dcp" / "meta.pt").exists()
    down = train(tmp_path, "b", "--steps", "8", "--checkpoint-dir", str(two), "--resume")
    assert down["resumed_from_step"] == 4
    _close(down["loss"], straight, 1e-6)
    # one process writes checkpoint.pt at step 4; 2 ranks continue it
    one = tmp_path / "one"
    train(tmp_path, "c", "--steps", "4", "--checkpoint-dir", str(one))
    up = train(tmp_path, "d", "--steps", "8", "--checkpoint-dir", str(one), "--resume", nproc=2)
    _close(up["loss"], straight, 1e-6)
    assert (one / "checkpoint.dcp").exists() and not (one / "checkpoint.pt").exists()


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes under a torchrun launched by us."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
        if env.get(b"TORCHELASTIC_RUN_ID") and b"RANK" in env and _descends(int(entry.name), launcher_pid):
            out[int(env[b"RANK"])] = int(entry.name)
    return out


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _start_and_kill_rank_1(tmp_path, steps, *extra):
    run = tmp_path / "run"
    out = tmp_path / "killed.json"
    cmd = [
        sys.executable, "-m", "slipstream", *COMMON, "--recipe", RECIPE, "--steps", str(steps), "--json", str(out),
        "--checkpoint-dir", str(run), "--checkpoint-every", "2", "--nproc", "2", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 120
    while not (run / "checkpoint.dcp" / "meta.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.2)
    ranks = _rank_pids(proc.pid)
    assert set(ranks) == {0, 1}
    os.kill(ranks[1], signal.SIGKILL)
    return proc, run, out, time.monotonic()


def test_a_killed_rank_ends_the_run_with_a_message_and_resume_continues(tmp_path):
    proc, run, _, killed_at = _start_and_kill_rank_1(tmp_path, 2000)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - killed_at < 60
    assert proc.returncode != 0
    assert "rank 1" in err.lower() or "ChildFailedError" in err or "exitcode" in err, err[-2000:]
    out = train(tmp_path, "resumed", "--steps", "12", "--checkpoint-dir", str(run), "--resume", nproc=2)
    assert out["resumed_from_step"] >= 2 and len(out["loss"]) == 12


def test_torchrun_restarts_the_ranks_and_they_resume_from_the_checkpoint(tmp_path):
    proc, run, out, _ = _start_and_kill_rank_1(tmp_path, 150, "--max-restarts", "1")
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.read_text())
    assert len(result["loss"]) == 150 and result["resumed_from_step"] >= 2


# GPipe and interleaved 1F1B are checked against one process in test_pipeline.py (runner level);
# here 1F1B goes through `slipstream train` end to end. The one-process run uses the same recipe
# (strategy=pipeline means nothing to one process), so checkpoints can move between the two.
PIPELINE = (
    RECIPE.replace("batches_per_step=2", "batches_per_step=1")
    + '+distributed.strategy="pipeline"+distributed.pipeline_schedule="1f1b"+distributed.microbatches=4'
)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """4 steps uninterrupted, validated at steps 0, 2 and 4: one process, and 2 pipeline stages."""
    tmp = tmp_path_factory.mktemp("pipelined")
    val = ["--eval-every", "2", "--eval-batches", "2"]
    one = train(tmp, "one", "--steps", "4", *val, recipe=PIPELINE)
    piped = train(tmp, "piped", "--steps", "4", *val, nproc=2, recipe=PIPELINE)
    return one, piped


def test_pipeline_stages_follow_one_process(pipelined):
    one, piped = pipelined
    _close(piped["loss"], one["loss"], 1e-5)
    # validation runs the batches through the stages, forward only, and matches one process
    assert [v["step"] for v in piped["val_loss"]] == [0, 2, 4] == [v["step"] for v in one["val_loss"]]
    _close([v["loss"] for v in piped["val_loss"]], [v["loss"] for v in one["val_loss"]], 1e-5)
    assert piped["pipeline_stages"] == [0] and piped["distributed_strategy"] == "pipeline"
    assert "world_size" not in one or one["world_size"] == 1


def test_pipeline_checkpoints_resume_in_stages_and_in_one_process(tmp_path, pipelined):
    one, piped = pipelined
    # 2 stages write a checkpoint at step 2, keyed by the whole GPT's parameter names
    staged = tmp_path / "staged"
    train(tmp_path, "a", "--steps", "2", "--checkpoint-dir", str(staged), nproc=2, recipe=PIPELINE)
    assert (staged / "checkpoint.dcp" / "meta.pt").exists()
    copy = tmp_path / "copy"
    shutil.copytree(staged, copy)
    # ...the stages continue it exactly,
    again = train(
        tmp_path, "b", "--steps", "4", "--checkpoint-dir", str(staged), "--resume", nproc=2, recipe=PIPELINE
    )
    assert again["resumed_from_step"] == 2
    _close(again["loss"], piped["loss"], 1e-6)
    # ...one process holding the whole model continues it (2 -> 1),
    down = train(tmp_path, "c", "--steps", "4", "--checkpoint-dir", str(copy), "--resume", recipe=PIPELINE)
    _close(down["loss"], one["loss"], 1e-5)
    # ...and 2 stages continue a one-process checkpoint.pt (1 -> 2)
    single = tmp_path / "single"
    train(tmp_path, "d", "--steps", "2", "--checkpoint-dir", str(single), recipe=PIPELINE)
    up = train(
        tmp_path, "e", "--steps", "4", "--checkpoint-dir", str(single), "--resume", nproc=2, recipe=PIPELINE
    )
    _close(up["loss"], one["loss"], 1e-5)
    assert (single / "checkpoint.dcp").exists() and not (single / "checkpoint.pt").exists()
