"""fusefs.Operations called directly (no kernel): what it answers without asking the cache."""

import errno
import os
import stat
import subprocess
import time
from types import SimpleNamespace

import pyfuse3
import pytest

from fusefs.cache import Attr
from fusefs.operations import Operations
from support import run


def test_fusefs_answers_enametoolong_for_the_names_it_refuses_itself():
    """symlink, link and mknod of a non-file never reach the cache: the length comes first."""
    ops = Operations(cache=None)

    async def refused(name: bytes) -> list[int]:
        out = []
        for call in (lambda: ops.symlink(1, name, b"target", None),
                     lambda: ops.link(5, 1, name, None),
                     lambda: ops.mknod(1, name, 0o10644, 0, None)):   # a fifo
            with pytest.raises(pyfuse3.FUSEError) as e:
                await call()
            out.append(e.value.errno)
        return out

    assert run(refused, b"n" * 256) == [errno.ENAMETOOLONG] * 3
    assert run(refused, b"n" * 255) == [errno.EPERM] * 3


class _Cache:
    """Just what open needs; every call is recorded."""

    def __init__(self, mode: int, setattr_fails: bool = False):
        self.mode, self.setattr_fails = mode, setattr_fails
        self.calls: list[tuple] = []

    def _attr(self) -> Attr:
        return Attr(7, stat.S_IFREG | self.mode, 1, 0, 0, 0, 0, 0, 0)

    async def open(self, ino, flags):
        self.calls.append(("open", ino, flags))
        return 42, self._attr()

    async def setattr(self, ino, **changes):
        self.calls.append(("setattr", ino, changes))
        if self.setattr_fails:
            raise OSError(errno.EIO, "gone")
        self.mode = changes["mode"]
        return self._attr()

    async def release(self, fh):
        self.calls.append(("release", fh))


@pytest.fixture(scope="module")
def unprivileged_pid():
    """A process of user nobody: no CAP_FSETID."""
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             "sleep", "600"])
    try:
        while True:   # until setpriv has dropped root and run sleep
            with open(f"/proc/{proc.pid}/comm") as f:
                if f.read().strip() == "sleep":
                    break
            assert proc.poll() is None, "setpriv failed"
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("who", ["nobody", "nobody, /proc unreadable", "root"])
@pytest.mark.parametrize("mode, flags, after", [
    (0o4777, os.O_WRONLY | os.O_TRUNC, 0o777),
    (0o6775, os.O_RDWR | os.O_TRUNC, 0o775),
    (0o2767, os.O_WRONLY | os.O_TRUNC, None),   # S_ISGID without group execute stays
    (0o4777, os.O_WRONLY, None),                # no truncation: nothing to clear
    (0o777, os.O_WRONLY | os.O_TRUNC, None),    # no bits: no extra request
])
def test_open_o_trunc_by_a_user_without_cap_fsetid_clears_setid_bits(unprivileged_pid, who, mode,
                                                                     flags, after):
    """The open truncates (FUSE_ATOMIC_O_TRUNC), so no setattr comes from the kernel that would
    clear the bits as truncate(2) does: fusefs clears them."""
    pid = {"nobody": unprivileged_pid, "nobody, /proc unreadable": 0, "root": os.getpid()}[who]
    ctx = SimpleNamespace(uid=0 if who == "root" else 65534, gid=0, pid=pid)
    cache = _Cache(mode)
    info = run(Operations(cache).open, 7, flags, ctx)
    assert info.fh == 42
    if after is None or who == "root":
        assert cache.calls == [("open", 7, flags)]
    else:
        assert cache.calls == [("open", 7, flags), ("setattr", 7, {"mode": after})]


def test_a_failed_clear_fails_the_open_and_releases_the_handle():
    ctx = SimpleNamespace(uid=65534, gid=65534, pid=0)
    cache = _Cache(0o4777, setattr_fails=True)
    with pytest.raises(pyfuse3.FUSEError) as e:
        run(Operations(cache).open, 7, os.O_WRONLY | os.O_TRUNC, ctx)
    assert e.value.errno == errno.EIO
    assert cache.calls[-1] == ("release", 42)
