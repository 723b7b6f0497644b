"""One training run per ``output_dir``.

The lock is ``flock`` on ``output_dir/.lock``, held by one process of a run (the main process under a distributed
launch) for the run's lifetime. The kernel drops it when that process exits, however it exits (SIGKILL included),
so a crashed run can be resumed at once. The file itself stays: deleting a lock file lets a third process lock a
new file while a second still holds the old one.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"


class OutputDirLock:
    """The held lock of an output_dir; ``release()`` (or the process's end) frees it."""

    def __init__(self, handle: IO[str] | None) -> None:
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the last descriptor of the open file drops its flock
            self._handle = None


def lock_output_dir(output_dir: str | Path) -> OutputDirLock:
    """Lock ``output_dir`` for this process, or raise a ValueError naming the folder and the holder's pid and host.

    Only on POSIX systems (``fcntl``); elsewhere nothing is locked.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        return OutputDirLock(None)
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    # opened without truncating: the holder's pid stays readable for the message of the one refused
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = handle.read().strip() or "unknown process"
        handle.close()
        raise ValueError(
            f"output_dir {folder} is in use by another training run ({holder}, which holds {path}). Two runs in one "
            "output_dir would overwrite each other's checkpoints: wait for that run to end, stop it, or pass another "
            "--output_dir. (The lock is freed when that process exits, even if it is killed.)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return OutputDirLock(handle)
