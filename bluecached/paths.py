"""Directories the daemons need (state directory, NVMe directory, mountpoint), created or
checked with a one-line reason when something is in the way, in the operator's terms: "state
directory /var/lib/bluecache is a file, not a directory" rather than "[Errno 17] File exists"."""

import errno
import os
import stat
from pathlib import Path


class PathProblem(Exception):
    """What is wrong with a directory the operator configured, phrased for them."""


def _not_a_dir(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, kind in ((stat.S_ISREG, "a file"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return f"{kind}, not a directory"
    return "not a directory"


def _symlink(path: Path) -> str:
    """'PATH is a symlink to TARGET, which ...' for a symlink that is not one to a directory."""
    target = os.readlink(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} is a symlink to {target}, which does not exist"
    except OSError as e:
        return f"{path} is a symlink to {target}: {e.strerror}"
    return f"{path} is a symlink to {target}, which is {_not_a_dir(st)}"


def not_a_directory(path: Path, what: str) -> str | None:
    """Why `path` cannot be a directory: it is a file (or a socket, ...), a symlink to one or
    to nothing, or it is under a file. None where nothing is in the way (it is a directory, or
    a symlink to one, or it and maybe some of its parents do not exist yet)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        for parent in path.parents:   # the nearest one that exists decides
            try:
                pst = os.lstat(parent)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISDIR(pst.st_mode) or os.path.isdir(parent):
                return None
            shown = _symlink(parent) if stat.S_ISLNK(pst.st_mode) else \
                f"{parent} is {_not_a_dir(pst)}"
            return f"{what} {path} cannot be created: {shown}"
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        return None if os.path.isdir(path) else f"{what} {_symlink(path)}"
    return f"{what} {path} is {_not_a_dir(st)}"


def make_directory(path: Path, what: str, mode: int = 0o700) -> None:
    """mkdir -p, raising PathProblem with a one-line reason that names `what` (e.g. "state
    directory") instead of an OSError."""
    path = Path(path)
    problem = not_a_directory(path, what)
    if problem:
        raise PathProblem(problem)
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        problem = not_a_directory(path, what)   # something made a file there meanwhile
        if problem:
            raise PathProblem(problem) from None
        raise PathProblem(f"cannot create {what} {path}: {describe(e, path)}") from None


def describe(e: OSError, about: Path | None = None) -> str:
    """An OSError without '[Errno N]': its strerror, after the path it concerns unless that is
    `about` (already named); EPERM, which for root mostly means an immutable directory, gets a
    hint."""
    text = e.strerror or str(e)
    if e.filename is not None and Path(os.fsdecode(e.filename)) != Path(about or ""):
        text = f"{os.fsdecode(e.filename)}: {text}"
    if e.errno == errno.EPERM:
        text += " (immutable? see lsattr -d)"
    return text


def fsync_directory(path: Path) -> None:
    """Makes a rename or a new file in `path` durable (the directory's own entry)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
