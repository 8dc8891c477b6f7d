"""A study worker for the multi-process tests: a trivial objective, the real run_study loop.

usage: python _worker.py STORAGE_URL STUDY N_TRIALS SLEEP_S [hang]
With `hang`, the worker's first trial sleeps for ten minutes (the test kills it mid-trial).
"""

import sys
import time

from slipstream.tune.search import open_storage, run_study
from slipstream.tune.space import ParamSpec

url, study_name, n_trials, sleep_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
hang = len(sys.argv) > 5 and sys.argv[5] == "hang"
space = [ParamSpec("x", 0.0, 1.0), ParamSpec("y", 0.0, 1.0)]


def objective(trial):
    x, y = (p.suggest(trial) for p in space)
    time.sleep(600 if hang else sleep_s)
    return (x - 0.3) ** 2 + (y - 0.6) ** 2


storage = open_storage(url, None, heartbeat_interval=1, grace_period=2)  # type: ignore[arg-type]
run_study(
    objective, space, study_name=study_name, storage=storage, n_trials=n_trials, method="tpe", poll_s=0.2
)
