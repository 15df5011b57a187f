"""The mountpoint's lifecycle: find and clear a mount left by a crashed hostd."""

import ctypes
import errno
import logging
import os
import subprocess
import threading
from pathlib import Path

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
    r = subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                       text=True)
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
