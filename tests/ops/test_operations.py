"""fusefs.Operations called directly (no kernel): what it answers without asking the cache."""

import errno
import os
import stat
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pyfuse3
import pytest

from fusefs.cache import Attr
from fusefs.operations import Operations
from support import run


class _Listing:
    """A directory of `count` entries (cookies 1..count) in a cache, and what was forgotten."""

    def __init__(self, count: int, parent: int = 3):
        self.entries = [(f"e{c}".encode(), Attr(100 + c, stat.S_IFREG | 0o644, 1, 0, 0, c,
                                                0, 0, 0), c) for c in range(1, count + 1)]
        self.parent = parent
        self.sent: Counter = Counter()        # entries handed out: references
        self.forgotten: Counter = Counter()   # references given back

    async def readdir(self, ino, offset, limit):
        out = [e for e in self.entries if e[2] > offset][:limit]
        self.sent.update(a.ino for _, a, _ in out)
        return self.parent, out

    async def forget(self, counts):
        for ino, n in counts:
            self.forgotten[ino] += n


def _list(monkeypatch, ops, ino: int, start: int, room: int) -> list[tuple[bytes, int, int]]:
    """One READDIRPLUS with room for `room` entries: (name, inode, offset) of those taken."""
    got = []

    def reply(token, name, attr, next_id):
        if len(got) == room:
            return False
        got.append((name, attr.st_ino, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    run(ops.readdir, ino, start, None)
    return got


def test_a_listing_starts_with_dot_and_dotdot_at_stable_offsets(monkeypatch):
    cache = _Listing(5)
    ops = Operations(cache)
    everything = _list(monkeypatch, ops, 7, 0, 100)
    assert everything == [(b".", 7, 1), (b"..", 3, 2)] + [
        (f"e{c}".encode(), 100 + c, c + 2) for c in range(1, 6)]
    # the kernel's next request starts at the last offset it took, whatever page size it had
    for room in (1, 2, 3):
        pages, offset = [], 0
        while True:
            page = _list(monkeypatch, ops, 7, offset, room)
            if not page:
                break
            pages += page
            offset = page[-1][2]
        assert pages == everything
    # `.` and `..` are no reference the kernel holds (it links no dentry for them); entries
    # handed out but not taken are given back to the cache
    assert set(ops.lookups) == {101, 102, 103, 104, 105}
    assert cache.forgotten  # pages of one or two entries left some
    assert Counter(ops.lookups) + cache.forgotten == cache.sent


def test_an_empty_directory_lists_dot_and_dotdot(monkeypatch):
    ops = Operations(_Listing(0, parent=1))
    assert _list(monkeypatch, ops, 1, 0, 100) == [(b".", 1, 1), (b"..", 1, 2)]
    assert _list(monkeypatch, ops, 1, 1, 100) == [(b"..", 1, 2)]
    assert _list(monkeypatch, ops, 1, 2, 100) == []


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
