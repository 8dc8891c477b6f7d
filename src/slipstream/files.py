"""Writing files so that nothing the user had is lost: atomic writes (a crash leaves the old file
or the new one), a full disk reported in one line with the old file kept, JSON documents.

Every component writes through these (recipes, reports, results, checkpoints, caches). Named
`files`, not `io`: a module named like the standard library's shadows it for anyone who runs a
file from inside the package folder.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from .errors import RecipeError


class DiskFullError(RecipeError, OSError):
    """The disk (or the process's file-size limit) ran out while writing a file; the message says
    which file and the fix. Still an OSError, so code that shrugs off a failed cache write goes on."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def out_of_space(err: BaseException) -> OSError | None:
    """The disk-full OSError behind `err`: itself, or what it was raised from or while handling
    (torch.save wraps the file's OSError in a RuntimeError); None for any other failure."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _temp_prefix(path: Path) -> str:
    """Temp files are named after the target, this host and this process, so a later writer can
    tell a temp left by a killed process (same host, process gone) from a live writer's."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())
    return f".{path.name}.{host}-{os.getpid()}."


def _remove_stale_temps(path: Path) -> None:
    """Remove temps of `path` that a killed writer on this host left behind (its process is gone)."""
    host = _temp_prefix(path).rsplit("-", 1)[0]
    for tmp in path.parent.glob(f"{glob.escape(host)}-*.tmp"):
        pid = tmp.name[len(host) + 1 :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # alive, but another user's


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """The permissions a plain open() would leave: the replaced file's own, else 0666 less the
    umask. mkstemp creates 0600 files, which others sharing a run folder could not read."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the directory entry, not only the file's bytes)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` so that a crash leaves the old `path` or the new one, never a torn one:
    a temp file beside it, fsynced, renamed over it, and the rename made durable. A full disk
    raises DiskFullError (one line, naming the file) with the old file untouched and no temp left
    behind. `write` streams into the file (a checkpoint is not built in memory first)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_dir(path.parent)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        full = out_of_space(err)
        if full is not None:
            raise DiskFullError(
                f"no space left writing {path} ({full.strerror}); free space or choose another folder"
            ) from err
        raise
    _remove_stale_temps(path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """atomic_write for bytes already in memory."""
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write_bytes for text (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str] | None, payload: Any) -> None:
    """Write `payload` as indented JSON atomically; no-op when `path` is empty (no --json given)."""
    if path:
        atomic_write_text(Path(path), json.dumps(payload, indent=2, default=str) + "\n")
