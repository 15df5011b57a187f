"""A directory's attributes after this mount changed its entries: hostd answers the kernel's
next GETATTR of it from bluecached's reply to the change (hostd/dir_attrs.py). What the kernel
shows must be what bluecached holds, and a changed mode must count at once."""

import errno
import os

import pytest
from test_permissions import _WRITE, as_nobody

from support import let_others_reach

ATTRS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_mtime_ns", "st_ctime_ns")


@pytest.fixture
def engine():
    """Directory attributes are the namespace's business, not the DMA engine's."""
    return "loopback"


def _daemon_view(s, path: str) -> tuple:
    client = s.daemon.client()
    try:
        ino = os.stat(path).st_ino
        a = client.call("getattr", ino=ino)
    finally:
        client.close()
    return a["mode"], a["nlink"], a["uid"], a["gid"], a["size"], a["mtime_ns"], a["ctime_ns"]


def test_a_directory_reads_as_bluecached_holds_it_after_each_change(mounted):
    s = mounted()
    d = str(s.mnt / "d")
    os.mkdir(d)
    f = os.path.join(d, "f")
    changes = [
        ("create", lambda: os.close(os.open(f + ".tmp", os.O_WRONLY | os.O_CREAT, 0o644))),
        ("rename", lambda: os.rename(f + ".tmp", f)),
        ("link", lambda: os.link(f, f + ".2")),
        ("symlink", lambda: os.symlink("f", f + ".s")),
        ("mknod", lambda: os.mknod(f + ".p", 0o600)),
        ("mkdir", lambda: os.mkdir(f + ".d")),
        ("rmdir", lambda: os.rmdir(f + ".d")),
        ("unlink", lambda: os.unlink(f + ".2")),
        ("rename away", lambda: os.rename(f, str(s.mnt / "moved"))),
    ]
    for what, change in changes:
        change()
        st = os.stat(d)   # the change dropped the kernel's copy: a GETATTR, answered by hostd
        assert tuple(getattr(st, a) for a in ATTRS) == _daemon_view(s, d), what
        root = os.stat(s.mnt)
        assert tuple(getattr(root, a) for a in ATTRS) == _daemon_view(s, str(s.mnt)), what


def test_a_mode_change_counts_for_the_next_create_in_the_directory(mounted):
    s = mounted()
    let_others_reach(str(s.mnt))
    d = str(s.mnt / "shared")
    os.mkdir(d)
    os.chmod(d, 0o777)
    assert as_nobody(_WRITE, os.path.join(d, "a")) == "0"
    os.close(os.open(os.path.join(d, "b"), os.O_WRONLY | os.O_CREAT, 0o644))   # kept here
    os.chmod(d, 0o755)
    assert as_nobody(_WRITE, os.path.join(d, "c")) == str(errno.EACCES)
    os.unlink(os.path.join(d, "b"))   # kept here again, with the new mode
    assert as_nobody(_WRITE, os.path.join(d, "c")) == str(errno.EACCES)
    assert os.stat(d).st_mode & 0o777 == 0o755
