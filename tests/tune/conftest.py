"""`postgres_url`: a throwaway PostgreSQL server for the whole session, started by scripts/postgres.sh.

The server runs from its own folder under /tmp (as root, the script hands it to the `postgres` user,
which must be able to reach it: pytest's own tmp folders are root-only) on a free loopback port, and
is stopped by `pg_ctl stop` on that folder at the end, which signals only the server it started.
Without server binaries (and no root to install them) the tests that use it skip with the script's
one-line reason; `make test` runs `scripts/postgres.sh ensure` first, which installs them as root.
"""

import importlib.util
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "postgres.sh"
NO_BINARIES = 3  # the script's exit status when initdb / pg_ctl are missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    if not any(importlib.util.find_spec(m) for m in ("psycopg", "psycopg2")):
        pytest.skip("no PostgreSQL driver: pip install 'psycopg[binary]' (part of slipstream[tune])")
    folder = Path(tempfile.mkdtemp(prefix="slipstream-pg-"))
    started = False
    try:
        for _ in range(3):  # another process may take the free port before the server binds it
            run = subprocess.run(
                ["bash", str(SCRIPT), "start", str(folder), str(_free_port())],
                capture_output=True,
                text=True,
                timeout=180,
            )
            if run.returncode == NO_BINARIES:
                pytest.skip(run.stdout.strip().splitlines()[-1])
            if run.returncode == 0:
                started = True
                break
            subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], capture_output=True, timeout=120)
            shutil.rmtree(folder / "data", ignore_errors=True)
        if not started:
            raise RuntimeError(f"scripts/postgres.sh start failed:\n{run.stdout}\n{run.stderr}")
        yield run.stdout.strip().splitlines()[-1]
    finally:
        if started:
            subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)
