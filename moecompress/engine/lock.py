"""One run at a time per output (and per statistics-cache entry being computed).

A lock is an open file ``.<name>.lock`` beside what it guards, held with ``fcntl.flock``: the kernel
releases it when the process ends, however it ends, so a lock left by a dead process is never in the
way (its file is reused). The file records who holds it (pid, host, start time, command) for the
message a second run gets at once: ``error: output out/x is being written by another run (pid 4242 on
host, started 10:31:02: moecompress apply r.yaml); wait for it or choose another output``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from moecompress.errors import LockedError

try:  # POSIX; elsewhere an O_EXCL file stands in (a crash can leave it: the message says which file)
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]


def lock_path(target: str | Path) -> Path:
    t = Path(target)
    return t.parent / f".{t.name}.lock"


class RunLock:
    """``with RunLock(path, what)``: hold the lock of ``path`` or raise :class:`LockedError` at once."""

    def __init__(self, target: str | Path, what: str) -> None:
        self.path = lock_path(target)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | (0 if fcntl is not None else os.O_EXCL)
        while True:
            try:
                fd = os.open(self.path, flags, 0o644)
            except FileExistsError:
                raise LockedError(f"{self.what} is locked by {self.path}; remove it if no run is active") from None
            if fcntl is None:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise LockedError(
                    f"{self.what} is being written by another run ({holder}); wait for it or choose another"
                    " output"
                ) from None
            try:  # the holder we waited for may have unlinked this file: lock the one at the path
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%H:%M:%S"),
                "command": " ".join(sys.argv)[:200]}  # fmt: skip
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlink while holding: a waiting run then makes a new file
        finally:
            os.close(self._fd)  # closing releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a run that is starting"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command')}"
