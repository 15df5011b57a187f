"""One bluecached per state directory (and per NVMe directory).

Two daemons on one state directory would take each other's sockets over, and the NVMe tier's
journal and checkpoints are written by one process only: a second one's checkpoint deletes the
journal the first is still appending to. So bluecached holds an exclusive flock(2) on a lock
file in each directory it owns, from before it touches anything in them until it exits. The
kernel drops the lock with the process (SIGKILL included): there is nothing stale to clean up.
The holder writes its PID into the file so that the refusal can say who holds it.
"""

import errno
import fcntl
import os
import time
from pathlib import Path

from .paths import PathProblem, describe, make_directory

LOCK_NAME = "bluecached.lock"
_PID_WAIT_S = 1.0   # a holder writes its PID right after it took the lock


class DirectoryInUse(Exception):
    """Another process holds the directory; the message names it and the holder's PID."""


class DirLock:
    """An exclusive lock on `directory` (created 0700 if missing), held until release() or
    the process ends. `what` names the directory in the refusal ("state directory"). A
    directory that cannot be made or written is a PathProblem, in one line."""

    def __init__(self, directory: Path, what: str):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.what = what
        self._fd = -1

    def acquire(self) -> "DirLock":
        make_directory(self.directory, self.what)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PathProblem(f"{self.what} {self.directory} is not writable: "
                                  f"{describe(e, self.path)}") from None
            raise PathProblem(f"{self.what} {self.directory}: cannot open {self.path}: "
                              f"{describe(e, self.path)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = f"bluecached pid {holder}" if holder else "another bluecached"
            raise DirectoryInUse(f"{self.what} {self.directory} is in use by {who}") from None
        except BaseException:
            os.close(fd)
            raise
        if not os.access(self.directory, os.W_OK | os.X_OK):
            # The lock file was there already; the sockets, journal, segments would not be.
            os.close(fd)
            hint = " (immutable? see lsattr -d)" if os.geteuid() == 0 else ""
            raise PathProblem(f"{self.what} {self.directory} is not writable{hint}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)   # the file stays: unlinking it would race with a new locker
            self._fd = -1


def _holder(fd: int) -> int | None:
    deadline = time.monotonic() + _PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def lock_directories(state_dir: Path, nvme_dir: Path | None) -> list[DirLock]:
    """Locks the state directory, and the NVMe tier's directory (its segments, journal and
    index snapshots) where it is not the state directory itself. Raises DirectoryInUse, or
    PathProblem for a directory that cannot be made or written."""
    locks = [DirLock(state_dir, "state directory").acquire()]
    try:
        if nvme_dir is not None and Path(nvme_dir).resolve() != Path(state_dir).resolve():
            locks.append(DirLock(nvme_dir, "NVMe directory").acquire())
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
