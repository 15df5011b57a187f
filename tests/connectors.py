"""The POSIX connectors' syscall sequences (../shared/facts/posix-clients.md), as functions the
mount tests, fault tests and benchmarks share."""

import ctypes
import hashlib
import os

MiB = 1 << 20


def llmd_write(root, rel: str, data: bytes, tag: str) -> bool:
    """llm-d FS backend store of one block. Returns False if it found the block present."""
    dst = os.path.join(root, rel)
    try:
        os.close(os.open(dst, os.O_RDONLY))
        _touch_atime(dst)   # dedup path: utimensat(dst, {UTIME_NOW, UTIME_OMIT})
        return False
    except FileNotFoundError:
        pass
    parent = os.path.dirname(dst)
    parts = []
    while not os.path.exists(parent):
        parts.append(parent)
        parent = os.path.dirname(parent)
    for p in reversed(parts):
        try:
            os.mkdir(p, 0o777)
        except FileExistsError:
            pass                          # another thread won the race: must be EEXIST
    tmp = f"{dst}_{tag}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        assert os.writev(fd, [data]) == len(data)
        os.rename(tmp, dst)               # while the fd is still open
    finally:
        os.close(fd)                      # FLUSH/RELEASE arrive after the RENAME
    return True


def _touch_atime(path: str) -> None:
    """utimensat(path, {UTIME_NOW, UTIME_OMIT}) through ctypes: Python's os.utime cannot say
    UTIME_OMIT."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    utime_now, utime_omit = (1 << 30) - 1, (1 << 30) - 2
    times = (Timespec * 2)(Timespec(0, utime_now), Timespec(0, utime_omit))
    if libc.utimensat(-100, os.fsencode(path), times, 0) != 0:   # AT_FDCWD
        raise OSError(ctypes.get_errno(), "utimensat")


def llmd_read(root, rel: str) -> bytes:
    fd = os.open(os.path.join(root, rel), os.O_RDONLY)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        out = bytearray()
        while len(out) < size:
            chunk = os.read(fd, min(8 * MiB, size - len(out)))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def block_name(i: int) -> str:
    h = hashlib.sha256(str(i).encode()).hexdigest()
    return f"llama_abc123_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"
