"""Workers on one study in a real PostgreSQL server (the `postgres_url` fixture, conftest.py): the
properties test_workers.py checks on SQLite, across processes that share nothing but the database.

- two `slipstream tune` processes with the same command line (the same --seed, even) fill a
  20-trial study with 20 distinct parameter sets (StudyLock: one worker asks at a time);
- a worker SIGKILLed mid-trial leaves its trial FAILED (heartbeat) and the other finishes the count;
- the study lock dies with the worker that holds it.
"""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState
from test_workers import _start, _trials, assert_killed_worker_failed_and_survivor_finished

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_cli_workers_fill_20_trials_without_duplicates(postgres_url, tmp_path):
    n = 20
    cmd = [sys.executable, "-m", "slipstream.cli", "tune", "--objective", "branin", "--trials", str(n)]
    cmd += ["--study", "two-workers", "--storage", postgres_url, "--heartbeat", "1", "--no-plots"]
    cmd += ["--seed", "7"]  # the same line on every machine: the seeds still differ per worker
    # Each worker imports first and then waits at a barrier: on 2 busy cores one worker's imports
    # once lagged so far that the other had finished all 20 trials alone (CI, 2026-12-06). Branin
    # takes microseconds, so even after the barrier one worker could still ask all 20 before the
    # other had opened the database (3d2f52a, twice): each worker's first trial waits until the
    # other has one running too. The CLI, storage and lock are the real ones; only the objective's
    # first call blocks.
    go = tmp_path / "go"
    barrier = (
        "import dataclasses, pathlib, sys, time, optuna, slipstream.cli, slipstream.tune.cli\n"
        "from slipstream.tune import objectives\n"
        "ready, go, here = (pathlib.Path(a) for a in sys.argv[1:4])\n"
        "branin = objectives.SYNTHETIC['branin']\n"
        "mine = here / f'{ready.stem}.trial'\n"
        "def first_waits(p):\n"
        "    if not mine.exists():\n"
        "        mine.touch()\n"
        "        deadline = time.monotonic() + 120\n"
        "        while len(list(here.glob('*.trial'))) < 2 and time.monotonic() < deadline: time.sleep(0.02)\n"
        "    return branin.fn(p)\n"
        "objectives.SYNTHETIC['branin'] = dataclasses.replace(branin, fn=first_waits)\n"
        "ready.touch()\n"
        "while not go.exists(): time.sleep(0.02)\n"
        "sys.exit(slipstream.cli.main(sys.argv[4:]))\n"
    )
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", barrier, str(tmp_path / f"{w}.ready"), str(go), str(tmp_path), *cmd[3:]]
            + ["--run-dir", str(tmp_path / w), "--json", str(tmp_path / f"{w}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for w in ("a", "b")
    ]
    _wait_for(lambda: all((tmp_path / f"{w}.ready").exists() for w in "ab"), 120, "both workers imported")
    go.touch()
    outs = [p.communicate(timeout=240)[0] for p in procs]
    elapsed = time.perf_counter() - t0
    assert [p.returncode for p in procs] == [0, 0], outs

    trials = optuna.load_study(study_name="two-workers", storage=postgres_url).get_trials(deepcopy=False)
    assert len(trials) == n and all(t.state == TrialState.COMPLETE for t in trials)  # exact: no 21st
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == n
    per_worker = {}
    for t in trials:
        per_worker[t.user_attrs["slipstream_worker"]] = (
            per_worker.get(t.user_attrs["slipstream_worker"], 0) + 1
        )
    assert len(per_worker) == 2  # both took part
    for w in ("a", "b"):
        summary = json.loads((tmp_path / f"{w}.json").read_text())
        assert summary["method"] == "gp" and summary["states"]["COMPLETE"] == n
    # Branin's box is 15 x 15: the closest two points, for the record (not a pass/fail line).
    closest = min(
        math.dist([v for _, v in a], [v for _, v in b]) for a, b in itertools.combinations(params, 2)
    )
    print(
        f"\n2 workers, {n} trials ({', '.join(map(str, per_worker.values()))}), "
        f"{n - len(set(params))} duplicates, closest pair {closest:.3g} apart, {elapsed:.1f} s"
    )


def test_killed_worker_leaves_a_failed_trial_and_the_other_finishes(postgres_url):
    url, n = postgres_url, 8
    t0 = time.perf_counter()
    doomed = _start(url, "crash", n, 0.0, "hang")
    survivor = _start(url, "crash", n, 0.3)

    def doomed_mid_trial():
        try:  # the worker attribute is set once the trial's first heartbeat is written
            return any(
                t.state == TrialState.RUNNING
                and t.user_attrs.get("slipstream_worker", "").endswith(f":{doomed.pid}")
                for t in _trials(url, "crash")
            )
        except KeyError:  # the study does not exist yet
            return False

    _wait_for(doomed_mid_trial, 120, "the doomed worker to start a trial")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=30)
    assert survivor.wait(timeout=240) == 0
    elapsed = time.perf_counter() - t0

    trials = assert_killed_worker_failed_and_survivor_finished(url, "crash", doomed.pid, survivor.pid, n)
    states = [t.state.name for t in trials]
    print(
        f"\nkilled worker: 1 FAIL; survivor: {states.count('COMPLETE')} complete, {len(trials)} trials, {elapsed:.1f} s"
    )


def test_study_lock_dies_with_its_worker(postgres_url):
    from slipstream.tune.search import StudyLock, open_storage

    storage = open_storage(postgres_url, None)  # type: ignore[arg-type]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from slipstream.tune.search import StudyLock, open_storage\n"
            "lock = StudyLock(open_storage(sys.argv[1], None), 'locked')\n"
            "lock.acquire(); print('held', flush=True); time.sleep(600)\n",
            postgres_url,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = StudyLock(storage, "locked", wait_s=0.5)
        assert lock.kind == "postgresql advisory lock"
        with pytest.warns(UserWarning, match="still taken"):
            lock.acquire()  # gives up after wait_s
        assert not lock.held
        other = StudyLock(storage, "another study", wait_s=0.5)
        other.acquire()  # one lock per study
        assert other.held
        other.close()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        lock.wait_s = 30
        t0 = time.perf_counter()
        lock.acquire()
        assert lock.held
        print(f"\nlock free {time.perf_counter() - t0:.2f} s after its holder was killed")
        lock.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
