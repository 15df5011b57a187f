"""Name length through the kernel: a name over 255 bytes is ENAMETOOLONG in every operation,
as on any Linux file system (never ENOENT); 255 bytes is a legal name everywhere."""

import errno
import os

import pytest

LONGEST = 255


@pytest.fixture
def engine():
    """Names are the namespace's business, not the DMA engine's."""
    return "loopback"


def _errno(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return 0


def test_every_operation_on_a_name_over_255_bytes_is_enametoolong(mounted):
    s = mounted()
    root = str(s.mnt)
    d = os.path.join(root, "d")
    os.mkdir(d)
    ok = os.path.join(d, "k" * LONGEST)
    with open(ok, "wb") as f:
        f.write(b"x")
    for length in (LONGEST + 1, 1000):
        long = os.path.join(d, "n" * length)
        ops = {
            "stat": lambda p=long: os.stat(p),
            "open": lambda p=long: os.open(p, os.O_RDONLY),
            "create": lambda p=long: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644),
            "mknod": lambda p=long: os.mknod(p, 0o644),
            "mkdir": lambda p=long: os.mkdir(p),
            "chmod": lambda p=long: os.chmod(p, 0o600),
            "chown": lambda p=long: os.chown(p, 1, 1),
            "utime": lambda p=long: os.utime(p),
            "truncate": lambda p=long: os.truncate(p, 0),
            "unlink": lambda p=long: os.unlink(p),
            "rmdir": lambda p=long: os.rmdir(p),
            "rename from": lambda p=long: os.rename(p, ok),
            "rename to": lambda p=long: os.rename(ok, p),
            "symlink": lambda p=long: os.symlink("target", p),
            "link": lambda p=long: os.link(ok, p),
            "readdir": lambda p=long: os.listdir(p),
        }
        for _ in range(2):   # nothing negative is cached for such a name either
            got = {op: _errno(fn) for op, fn in ops.items()}
            assert got == dict.fromkeys(ops, errno.ENAMETOOLONG), f"{length} bytes"
    assert os.listdir(d) == ["k" * LONGEST]
    with open(ok, "rb") as f:
        assert f.read() == b"x"

    # 255 bytes: a legal name in every operation
    other = os.path.join(d, "m" * LONGEST)
    os.chmod(ok, 0o600)
    os.chown(ok, 1, 1)
    os.truncate(ok, 0)
    os.rename(ok, other)
    assert os.stat(other).st_mode & 0o7777 == 0o600 and os.stat(other).st_uid == 1
    os.unlink(other)
    os.mkdir(other)
    os.rmdir(other)
    assert os.listdir(d) == []
