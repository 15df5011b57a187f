"""The mountpoint's lifecycle: find and clear a mount left by a crashed hostd, and guard the
bare directory under the mount so that nothing is written there while the cache is not
mounted."""

import array
import ctypes
import errno
import fcntl
import logging
import os
import subprocess
import threading
from pathlib import Path

from bluecached.paths import PathProblem, make_directory

log = logging.getLogger("hostd.mount")
FSNAME = "bluecache"
MNT_DETACH = 2


class MountError(Exception):
    pass


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts_at(mountpoint: Path) -> list[dict]:
    """Entries of /proc/self/mountinfo for `mountpoint`, most recent last."""
    target = str(mountpoint)
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and _unescape(fields[4]) == target and len(tail) >= 2:
            out.append({"fstype": tail[0], "source": tail[1]})
    return out


def _detach(mountpoint: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(mountpoint), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    # Not root? fusermount3 can unmount a FUSE mount its user made.
    try:
        r = subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                           text=True)
    except OSError as e:
        raise MountError(f"cannot unmount stale {mountpoint}: {os.strerror(err)}; "
                         f"fusermount3: {e.strerror} (install fuse3)") from None
    if r.returncode != 0:
        raise MountError(f"cannot unmount stale {mountpoint}: {os.strerror(err)}; "
                         f"fusermount3: {r.stderr.strip()}")


def unmount(mountpoint: Path) -> None:
    """Unmounts; if processes still use the mount, detaches it (they keep their files, new
    path lookups no longer reach it) rather than leaving it mounted."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(mountpoint), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY:
        log.warning("%s is busy: detaching it lazily", mountpoint)
    _detach(mountpoint)


def clear_stale(mountpoint: Path) -> bool:
    """Unmounts a dead bluecache mount at `mountpoint`. Returns True if one was cleared;
    raises MountError if a live one is there (another hostd serves it) or something else is
    mounted there."""
    entries = mounts_at(mountpoint)
    if not entries:
        return False
    top = entries[-1]
    if not top["fstype"].startswith("fuse") or top["source"] != FSNAME:
        raise MountError(f"{mountpoint} already has a {top['fstype']} mount of {top['source']}")
    answer = _probe(mountpoint)
    if answer is None:
        raise MountError(f"{mountpoint} is a bluecache mount that does not answer within "
                         f"{PROBE_TIMEOUT_S}s: is a hung hostd still running?")
    if answer == 0:
        raise MountError(f"{mountpoint} is already served by a running hostd")
    if answer not in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO):
        raise MountError(f"{mountpoint}: {os.strerror(answer)}")
    log.warning("%s: clearing the mount a crashed hostd left (%s)", mountpoint,
                os.strerror(answer))
    _detach(mountpoint)
    return True


PROBE_TIMEOUT_S = 5


def _probe(mountpoint: Path) -> int | None:
    """Asks the mount's server something the kernel cannot answer from its caches (stat can
    be): 0 if it answered, an errno if the kernel said the server is gone, None on no answer."""
    result: list[int] = []

    def probe():
        try:
            os.listdir(mountpoint)
            result.append(0)
        except OSError as e:
            result.append(e.errno)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S)
    return result[0] if result else None


def make_mountpoint(mountpoint: Path) -> None:
    """Creates the mountpoint (and its parents) if missing; a MountError, in one line, where a
    file or a symlink to none is in the way, or it cannot be created."""
    try:
        make_directory(mountpoint, "mountpoint", mode=0o777)   # the umask applies
    except PathProblem as e:
        raise MountError(str(e)) from None


def fuse_device_problem() -> str | None:
    """Why no FUSE file system can be mounted here, or None. (A user's fusermount3 opens
    /dev/fuse itself, as root: only its existence is checked.)"""
    if not os.path.exists("/dev/fuse"):
        return ("/dev/fuse does not exist: load the fuse kernel module (modprobe fuse), or in "
                "a container, pass the device in")
    return None


# <linux/fs.h>: the inode flags chattr(1) sets. The kernel reads and writes an int.
FS_IOC_GETFLAGS = 0x80086601 if ctypes.sizeof(ctypes.c_long) == 8 else 0x80046601
FS_IOC_SETFLAGS = 0x40086602 if ctypes.sizeof(ctypes.c_long) == 8 else 0x40046602
FS_IMMUTABLE_FL = 0x00000010


def _get_flags(fd: int) -> int:
    buf = array.array("i", [0, 0])
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
    return buf[0]


def _set_flags(fd: int, flags: int) -> None:
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("i", [flags, 0]), True)


def _mount_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            return int(line.split()[1])
    raise OSError(errno.ENOSYS, "no mnt_id in /proc/self/fdinfo")


def _open_bare(mountpoint: Path) -> int:
    """An fd of the directory at `mountpoint`, which must not have anything mounted on it: it
    is on the same mount as its parent (mountinfo alone would miss a path through a symlink)."""
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            if _mount_id(fd) != _mount_id(parent):
                raise MountError(f"{mountpoint} is a mountpoint in use: cannot guard the "
                                 "directory under it")
        finally:
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def guard_bare(mountpoint: Path) -> None:
    """Makes the bare mountpoint directory (nothing may be mounted on it now) unwritable, so
    that a writer that reaches the path while the cache is not mounted (hostd stopped, the
    mount detached lazily under busy writers, or not started yet) gets an error instead of
    writing to the disk under it, where the next mount would hide what it wrote. Mode 000
    stops every user but root; the immutable attribute (`chattr +i`) stops root too, where the
    filesystem supports it and hostd holds CAP_LINUX_IMMUTABLE. Neither affects the mount on
    top. Both stay after hostd exits: that is the point. `chattr -i` lifts the attribute."""
    if os.geteuid() != 0:
        # fusermount3 mounts for a user only on a mountpoint that user can write to.
        log.info("%s: not guarded against writes while unmounted (hostd is not root)",
                 mountpoint)
        return
    fd = _open_bare(mountpoint)
    try:
        if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            log.info("%s: the directory under the mount is on a read-only filesystem: nothing "
                     "can be written there while the cache is not mounted", mountpoint)
            return
        problem = None
        try:
            flags = _get_flags(fd)
        except OSError as e:
            flags, problem = None, e
        immutable = flags is not None and bool(flags & FS_IMMUTABLE_FL)
        if os.fstat(fd).st_mode & 0o7777:
            if immutable:             # a mode changed by hand under a guard: lift, fix, guard
                _set_flags(fd, flags & ~FS_IMMUTABLE_FL)
                immutable = False
            os.fchmod(fd, 0)
        hidden = os.listdir(fd)
        if hidden:
            log.warning("%s: %d entries in the directory under the mount (written while the "
                        "cache was not mounted) are hidden by the mount, e.g. %s", mountpoint,
                        len(hidden), sorted(hidden)[0])
        if not immutable and flags is not None:
            try:
                _set_flags(fd, flags | FS_IMMUTABLE_FL)
                immutable = True
            except OSError as e:
                problem = e
        if immutable:
            log.info("%s: the directory under the mount is immutable and mode 000: nothing can "
                     "be written there while the cache is not mounted", mountpoint)
        else:
            why = ("hostd lacks CAP_LINUX_IMMUTABLE" if problem.errno == errno.EPERM else
                   f"the filesystem does not support it: {os.strerror(problem.errno)}")
            log.warning("%s: the directory under the mount is mode 000, but root can still "
                        "write there while the cache is not mounted: the immutable attribute "
                        "cannot be set (%s)", mountpoint, why)
    finally:
        os.close(fd)


def unguard_bare(mountpoint: Path, mode: int = 0o755) -> None:
    """Lifts guard_bare's protection of the bare directory (nothing may be mounted on it),
    e.g. to remove it: clears the immutable attribute and sets `mode`."""
    fd = _open_bare(mountpoint)
    try:
        try:
            flags = _get_flags(fd)
            if flags & FS_IMMUTABLE_FL:
                _set_flags(fd, flags & ~FS_IMMUTABLE_FL)
        except OSError as e:
            if e.errno not in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
