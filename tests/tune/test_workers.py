"""Several worker processes on one study in embedded SQLite storage: no duplicate parameter sets,
a killed worker's trial turns FAILED (heartbeat) and the study still reaches its trial count."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

WORKER = Path(__file__).with_name("_worker.py")


def _start(url, study, n, sleep_s, *extra):
    return subprocess.Popen([sys.executable, str(WORKER), url, study, str(n), str(sleep_s), *extra])


def assert_killed_worker_failed_and_survivor_finished(url, study, doomed_pid, survivor_pid, n):
    """The killed worker's trial is FAILED (heartbeat), the survivor ran all n, none is left RUNNING."""
    trials = _trials(url, study)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(failed) == 1 and failed[0].user_attrs["slipstream_worker"].endswith(f":{doomed_pid}")
    assert len(complete) == n
    assert all(t.user_attrs["slipstream_worker"].endswith(f":{survivor_pid}") for t in complete)
    assert not any(t.state == TrialState.RUNNING for t in trials)
    return trials


def _trials(url, study):
    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


def test_two_workers_share_a_study_without_duplicates(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    n = 10
    procs = [_start(url, "shared", n, 0.2) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0
    trials = _trials(url, "shared")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    # Each worker stops once n trials are finished or running, and counts and asks under the study
    # lock (an flock beside the SQLite file): never an extra trial.
    assert len(complete) == len(trials) == n
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == len(params)
    workers = {t.user_attrs["slipstream_worker"] for t in complete}
    assert len(workers) == 2  # both took part


def test_killed_worker_leaves_a_failed_trial_and_the_other_finishes(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    n = 6
    doomed = _start(url, "crash", n, 0.0, "hang")
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            # The worker attribute is set after the trial's first heartbeat.
            if any(t.state == TrialState.RUNNING and t.user_attrs for t in _trials(url, "crash")):
                break
        except KeyError:  # the study does not exist yet
            pass
        time.sleep(0.2)
    else:
        raise AssertionError("the first worker never started a trial")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=30)
    survivor = _start(url, "crash", n, 0.2)
    assert survivor.wait(timeout=300) == 0
    assert_killed_worker_failed_and_survivor_finished(url, "crash", doomed.pid, survivor.pid, n)


def test_a_trial_killed_before_its_first_heartbeat_is_failed_not_waited_on(tmp_path):
    """A worker killed after Optuna created its trial but before the trial's first heartbeat (while
    the sampler draws) left a RUNNING trial with no beat, which Optuna never calls stale: a resumed
    worker counted it as running and waited forever (a `tune` resume once stalled so)."""
    from slipstream.tune.search import open_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = open_storage(url, tmp_path, heartbeat_interval=1, grace_period=2)
    orphan = optuna.create_study(study_name="orphan", storage=storage).ask()  # RUNNING, never beaten
    n = 2
    survivor = _start(url, "orphan", n, 0.0)
    try:
        assert survivor.wait(timeout=120) == 0
    finally:
        survivor.kill()  # a no-op once it has exited; a worker left waiting must not outlive the test
    trials = _trials(url, "orphan")
    assert trials[orphan.number].state == TrialState.FAIL
    assert sum(t.state == TrialState.COMPLETE for t in trials) == n
    assert not any(t.state == TrialState.RUNNING for t in trials)
