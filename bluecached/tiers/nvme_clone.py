"""NVMe hits read by the kernel itself: a reflink clone of an object's extent as the backing file.

FUSE passthrough maps a file onto a whole backing file, offset for offset, and an object is an
extent in the middle of a segment file. A reflink clone (FICLONERANGE) into an unnamed file
(O_TMPFILE) makes a file of just the object's bytes: it shares the extent's disk blocks, copies
none, and costs ~0.1 ms for 32 MiB (ad hoc, btrfs on the 2-core AMD EPYC VM). Overwriting or
freeing the extent in the segment later leaves the clone as it was (copy on write): a reader
holds the bytes it opened.

The kernel then reads the disk without bluecached, so bluecached cannot check its CRC32Cs on
that path. This is only allowed where the filesystem checks every block it reads against a
checksum of its own and fails the read with EIO on a mismatch: btrfs with data checksums
(crc32c by default), not turned off by the mount (nodatasum, nodatacow) or for the directory
(chattr +C). ext4 and xfs keep no data checksums (xfs has reflinks): there a hit is read and
checked by bluecached (hit_path direct).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import re
import struct
from pathlib import Path

BTRFS_SUPER_MAGIC = 0x9123683E
FICLONERANGE = 0x4020940D       # _IOW(0x94, 13, struct file_clone_range)
FS_IOC_GETFLAGS = 0x80086601    # _IOR('f', 1, long)
FS_NOCOW_FL = 0x00800000        # btrfs: no copy on write, hence no data checksums
CLONE_ALIGN = 4096              # a clone covers whole blocks (btrfs's sector size here)


def _fs_magic(path: Path) -> int:
    """f_type of statfs(2): Python's os.statvfs leaves it out."""
    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = _Statfs()
    if libc.statfs(os.fsencode(str(path)), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return buf.f_type & 0xFFFFFFFF


_OCTAL = re.compile(r"\\([0-7]{3})")   # how mountinfo escapes space, tab, newline, backslash


def _mount_options(path: Path) -> set[str]:
    """The mount and superblock options of the mount holding `path` (/proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best, options = "", set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            point = _OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[4])   # \040: a space
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best = point
                options = set(fields[5].split(",")) | set(fields[sep + 3].split(","))
    return options


def unchecked_reason(directory: Path) -> str | None:
    """Why the filesystem holding `directory` does not check the data it reads back, or None
    where it does (btrfs with data checksums) and a clone into an unnamed file works there."""
    try:
        if _fs_magic(directory) != BTRFS_SUPER_MAGIC:
            return "not btrfs: the filesystem keeps no checksums of file data"
        off = _mount_options(directory) & {"nodatasum", "nodatacow"}
        if off:
            return f"btrfs mounted with {','.join(sorted(off))}: no data checksums"
        a = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            flags = struct.unpack("l", fcntl.ioctl(a, FS_IOC_GETFLAGS, struct.pack("l", 0)))[0]
            if flags & FS_NOCOW_FL:
                return "new files here are nodatacow (chattr +C): no data checksums"
            os.pwrite(a, b"\0" * CLONE_ALIGN, 0)
            os.close(clone(a, 0, CLONE_ALIGN, directory))
        finally:
            os.close(a)
    except OSError as e:
        return f"probing {directory}: {e.strerror or e}"
    return None


def clone(src_fd: int, offset: int, length: int, directory: Path) -> int:
    """A read-only fd of a new unnamed file in `directory` holding bytes [offset, offset +
    length) of `src_fd`, sharing their blocks. offset and length are multiples of
    CLONE_ALIGN. Raises OSError (EOPNOTSUPP where the filesystem has no reflinks)."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.ioctl(fd, FICLONERANGE, struct.pack("qQQQ", src_fd, offset, length, 0))
        # read-only: the kernel's passthrough (and any mmap through it) cannot change it
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)
