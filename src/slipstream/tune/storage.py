"""Where a study lives and who may sample next: SQLite in the run folder by default, a journal
file, or a database URL (PostgreSQL, MySQL) shared by workers on many machines with heartbeats;
the StudyLock that keeps concurrent workers from drawing the same point."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
import warnings
from pathlib import Path
from typing import Any

from ..recipe import RecipeError

METHODS = ("auto", "fibonacci", "evolutionary", "bayesian", "random", "tpe", "gp", "cmaes", "nsga2")
PRUNERS = ("median", "halving", "none")
GP_MAX_PARAMS = 10


def require_optuna() -> Any:
    if importlib.util.find_spec("optuna") is None:
        raise RecipeError(
            "slipstream tune needs Optuna: pip install 'slipstream[tune]' (optuna, scipy, cmaes)"
        )
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def has_module(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def storage_url(storage: str | None, run_dir: Path) -> str:
    """The storage a study lives in: the given URL, or SQLite in the run folder."""
    if storage:
        return storage
    return f"sqlite:///{(run_dir / 'study.db').resolve()}"


def open_storage(
    storage: str | None, run_dir: Path, *, heartbeat_interval: int = 10, grace_period: int | None = None
) -> Any:
    """Open (and create) the study storage; see the module docstring for the kinds."""
    require_optuna()
    url = storage_url(storage, run_dir)
    if url.startswith("journal:") or url.endswith(".journal"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise RecipeError(
            f"--storage {url!r} is not a database URL or a .journal file; "
            "use e.g. sqlite:///runs/study.db, postgresql://user@host/db or runs/study.journal"
        )
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    url = postgres_driver(url)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    try:
        return rdb_storage(url, engine_kwargs, heartbeat_interval, grace_period)
    except ImportError as err:  # Optuna re-raises the driver's ModuleNotFoundError as a bare ImportError
        missing = getattr(err.__cause__, "name", None) or err.name or "the driver"
        raise RecipeError(
            f"--storage {url.split('://')[0]}://...: the database driver is missing ({missing}); "
            "for PostgreSQL: pip install 'psycopg[binary]' (or pip install 'slipstream[tune]')"
        ) from err
    except Exception as err:  # SQLAlchemy's connection errors
        raise RecipeError(f"cannot open study storage {redact(url)}: {type(err).__name__}: {err}") from err


def postgres_driver(url: str) -> str:
    """Name the installed driver in a bare postgresql:// (or postgres://) URL.

    SQLAlchemy reads a bare postgresql:// as psycopg2 up to 2.0 and as psycopg (3) from 2.1 on, so
    the same URL works or fails with the driver missing depending on the version; `slipstream[tune]`
    installs psycopg 3. A URL that names its driver (postgresql+psycopg2://...) is kept."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        return url
    import sqlalchemy

    if has_module("psycopg") and int(sqlalchemy.__version__.split(".")[0]) >= 2:
        return f"postgresql+psycopg://{rest}"
    if has_module("psycopg2"):
        return f"postgresql+psycopg2://{rest}"
    return f"postgresql://{rest}"


def rdb_storage(
    url: str, engine_kwargs: dict[str, Any], heartbeat_interval: int, grace_period: int | None
) -> Any:
    import inspect

    import optuna
    import sqlalchemy.exc

    # A trial whose worker was killed is run again once, same parameters (so a killed base-recipe
    # trial is not lost); a point that kills its worker twice stays FAILED. Optuna 4.9 renamed
    # the argument (failed_trial_callback -> heartbeat_stale_trial_callback).
    retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    retry_cls = retry_cls or optuna.storages.RetryFailedTrialCallback
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    names = [a for a in ("heartbeat_stale_trial_callback", "failed_trial_callback") if a in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = {names[0]: retry_cls(max_retry=1)} if names else {}
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                # The heartbeat is marked experimental, and has been stable since Optuna 2.9.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period if grace_period is not None else 2 * heartbeat_interval,
                    **retry,
                )
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError):
            # Workers that open a new database together race to create its tables; the loser's
            # CREATE or version INSERT fails, and a second try finds the tables made.
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def redact(url: str) -> str:
    """Hide a password in a database URL before printing it."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else url
    return url


class StudyLock:
    """A lock over one study shared by all its workers, held while a worker asks for a trial.

    Why: a sampler draws a trial's point from the trials it can see, and a point another worker is
    still drawing is invisible (its trial has no parameters yet). Measured on PostgreSQL with two
    workers and the Gaussian-process sampler (which maximises the same acquisition function from
    the same data), two runs of 20 trials: one exact duplicate each, and 5 and 4 more pairs within
    0.02 in a 15 x 15 box. Held from counting the trials through creating one to storing all its
    parameters, the lock lets the next worker see that point as running (constant liar) and draw
    another, makes the trial count exact, and gives each seeded worker its own seed (the trials
    counted under the lock differ). Sampling is serialised, which costs a sampler call per trial:
    seconds for a synthetic objective, nothing next to a trial that trains a model.

    PostgreSQL: a session-level advisory lock on a connection of its own; SQLite and journal files:
    an flock on a file beside the study. A worker that dies holding either loses it with its
    connection or file. Other storages (MySQL, in-memory): no lock. A worker that waits `wait_s`
    goes on without it (a frozen holder must not stop the study)."""

    def __init__(self, storage: Any, study_name: str, *, wait_s: float = 300.0):
        self.kind = "none"
        self.wait_s = wait_s
        self.held = False
        self._conn: Any = None
        self._fd: int | None = None
        digest = hashlib.sha256(f"slipstream-tune:{study_name}".encode()).digest()
        self._key = int.from_bytes(digest[:8], "big", signed=True)
        engine = getattr(storage, "engine", None)
        backend = getattr(storage, "_backend", None)
        if engine is not None and engine.url.get_backend_name() == "postgresql":
            import sqlalchemy
            from sqlalchemy.pool import NullPool

            self._conn = (
                sqlalchemy.create_engine(engine.url, poolclass=NullPool)
                .connect()
                .execution_options(isolation_level="AUTOCOMMIT")
            )
            self.kind = "postgresql advisory lock"
        elif (
            engine is not None
            and engine.url.get_backend_name() == "sqlite"
            and engine.url.database not in (None, "", ":memory:")
        ):
            self._open_file(engine.url.database + ".lock")
        elif isinstance(getattr(backend, "_file_path", None), str):
            self._open_file(backend._file_path + ".lock")

    def _open_file(self, path: str) -> None:
        if importlib.util.find_spec("fcntl") is None:
            return
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.kind = "file lock"

    def _try(self) -> bool:
        if self._conn is not None:
            import sqlalchemy

            sql = sqlalchemy.text("SELECT pg_try_advisory_lock(:k)")
            return bool(self._conn.execute(sql, {"k": self._key}).scalar())
        if self._fd is not None:
            import fcntl

            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        return True

    def acquire(self) -> None:
        if self.held:
            return
        deadline = time.monotonic() + self.wait_s
        while not self._try():
            if time.monotonic() > deadline:
                warnings.warn(
                    f"study lock ({self.kind}) still taken after {self.wait_s:.0f} s: asking without it",
                    stacklevel=2,
                )
                return
            time.sleep(0.05)
        self.held = True

    @property
    def exclusive(self) -> bool:
        """Held, and a real lock: while it is, no live worker is between creating a trial and
        its first heartbeat (workers beat before they release it)."""
        return self.held and self.kind != "none"

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._conn is not None:
            import sqlalchemy

            self._conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
        elif self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        try:
            self.release()
        finally:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
