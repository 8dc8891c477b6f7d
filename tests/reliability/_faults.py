"""Faults injected from outside the process under test: nothing here reaches into slipstream.

- `Child` runs a `slipstream` command in its own session, output to a log file, and SIGKILLs it
  (then anything it started) the way the OOM killer or a power cut would.
- `FolderWatch` sees files appear, close and be renamed in one folder as it happens (Linux
  inotify), so a test can kill a writer in the middle of a checkpoint or report write.
- `file_size_limit(n)` caps every file the child writes at n bytes (RLIMIT_FSIZE, SIGXFSZ
  ignored): a write past it fails with EFBIG, as a full disk fails with ENOSPC.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

INOTIFY = sys.platform.startswith("linux")

IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
KINDS = {"created": IN_CREATE, "closed": IN_CLOSE_WRITE, "renamed": IN_MOVED_TO}


def slipstream_argv(*args: object) -> list[str]:
    return [sys.executable, "-m", "slipstream.cli", *map(str, args)]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    return env


def file_size_limit(limit: int):
    """preexec_fn: every file this child writes stops at `limit` bytes, and the write that would
    pass it fails with EFBIG (SIGXFSZ ignored, so no signal kills the child first)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


class Child:
    """One `slipstream ...` command in a session of its own, stdout and stderr to `log`."""

    def __init__(self, args: list[object], cwd: Path, log: Path):
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115  # closed in kill() / wait()
        self.proc = subprocess.Popen(
            slipstream_argv(*args),
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> int:
        """SIGKILL the command (nothing runs after it: no except, no finally, no atexit), then
        any process it started (its session's group); returns its exit status (-9 if killed)."""
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = self.proc.wait(timeout=60)
        self._reap_group()
        return rc

    def wait(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reap_group()
        return rc

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_output(self, pattern: str, timeout: float = 300) -> bool:
        """Block until a line of the log matches `pattern` (a regex; progress goes to stderr,
        which Python flushes per line); False when the child exits first or `timeout` passes.
        Anchors a kill to where the command is, not to how fast this host ran it there."""
        deadline = time.monotonic() + timeout
        while True:
            done = not self.alive() or time.monotonic() > deadline
            if re.search(pattern, self.output(), re.MULTILINE):
                return True
            if done:
                return False
            time.sleep(0.01)

    def _reap_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test created, if any is left
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


class FolderWatch:
    """File events in one folder from the moment the watch starts: ("created" | "closed" |
    "renamed", name, monotonic time). Linux only (inotify through libc)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = IN_CREATE | IN_CLOSE_WRITE | IN_MOVED_TO
        if self._libc.inotify_add_watch(self.fd, os.fsencode(folder), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder} failed")
        self.events: list[tuple[str, str, float]] = []

    def _drain(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        now = time.monotonic()
        pos = 0
        while pos + 16 <= len(data):
            _wd, mask, _cookie, length = struct.unpack_from("iIII", data, pos)
            name = data[pos + 16 : pos + 16 + length].rstrip(b"\0").decode(errors="replace")
            pos += 16 + length
            for kind, bit in KINDS.items():
                if mask & bit:
                    self.events.append((kind, name, now))

    def matching(self, kind: str, pattern: str) -> list[tuple[str, str, float]]:
        rx = re.compile(pattern)
        return [e for e in self.events if e[0] == kind and rx.fullmatch(e[1])]

    def wait_for(self, kind: str, pattern: str, nth: int, child: Child, timeout: float = 300) -> float | None:
        """Block until the `nth` `kind` event on a name matching `pattern` (a regex); returns its
        time, or None when the child exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            hits = self.matching(kind, pattern)
            if len(hits) >= nth:
                return hits[nth - 1][2]
            if not child.alive() or time.monotonic() > deadline:
                self._drain(0)
                hits = self.matching(kind, pattern)
                return hits[nth - 1][2] if len(hits) >= nth else None
            self._drain(0.05)

    def close(self) -> None:
        os.close(self.fd)


def temp_files(folder: Path) -> list[str]:
    """The hidden temp files an atomic writer makes beside its target (.NAME.*.tmp)."""
    return sorted(p.name for p in folder.glob(".*.tmp")) if folder.exists() else []
