"""Hard links in the store (no sockets, no kernel): one inode, one object, several names;
the cache's eviction takes every name with the object; the journal keeps the names."""

import errno
import os
import stat

import pytest

from bluecached.namespace import ROOT_INO, FsError, Namespace
from bluecached.tiers import index
from support import MiB, pattern, run


def _errno(fn, *args) -> int:
    with pytest.raises(FsError) as e:
        fn(*args)
    return e.value.errno


def _names(store, path: str) -> list[str]:
    """Every path of the inode at `path`, sorted."""
    node = store.ns.resolve(path)
    out = []
    for parent, name in node.names():
        base = store.ns.path_of(store.ns.inodes[parent]) if parent != ROOT_INO else b""
        out.append((base + b"/" + name).decode())
    return sorted(out)


def test_one_inode_one_object_several_names(harness):
    h = harness()
    s = h.store
    data = pattern("a", 3 * MiB + 5)
    run(h.put, "/d/a.bin", data)
    d = s.ns.resolve("/d").ino
    e = s.mkdir(ROOT_INO, b"e", 0o755, 0, 0).ino
    node = run(s.link, s.ns.resolve("/d/a.bin").ino, e, b"b.bin")
    assert node is s.ns.resolve("/e/b.bin") is s.ns.resolve("/d/a.bin")
    assert node.nlink == 2 and _names(s, "/d/a.bin") == ["/d/a.bin", "/e/b.bin"]
    assert run(h.get, "/e/b.bin") == data
    # a write through one name is the content under the other
    handle = run(s.open, node.ino, os.O_WRONLY)
    run(h.write, handle.fh, 0, b"XYZ")
    s.release(handle.fh)
    assert run(h.get, "/d/a.bin") == b"XYZ" + data[3:]
    assert {n: c.nlink for n, c, _ in s.readdir(e, 0)} == {b"b.bin": 2}
    # counted once: one object
    assert s.logical_bytes == len(data)
    assert s.usage("/")["files"] == 1 and s.usage("/")["bytes"] == len(data)
    # unlink of one name: the other keeps the file
    s.unlink(d, b"a.bin")
    assert node.nlink == 1 and _names(s, "/e/b.bin") == ["/e/b.bin"]
    assert run(h.get, "/e/b.bin") == b"XYZ" + data[3:]
    h.check_consistency()


def test_link_rules(harness):
    h = harness()
    s = h.store
    run(h.put, "/f", b"x")
    f = s.ns.resolve("/f").ino
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    assert _errno(run, s.link, d, ROOT_INO, b"d2") == errno.EPERM        # directories
    assert _errno(run, s.link, f, ROOT_INO, b"d") == errno.EEXIST
    assert _errno(run, s.link, f, ROOT_INO, b"f") == errno.EEXIST
    assert _errno(run, s.link, f, 999, b"x") == errno.ESTALE             # no such inode
    assert _errno(run, s.link, 999, ROOT_INO, b"x") == errno.ESTALE
    assert _errno(run, s.link, f, f, b"x") == errno.ENOTDIR
    assert _errno(run, s.link, f, ROOT_INO, b"n" * 256) == errno.ENAMETOOLONG
    assert _errno(run, s.link, f, ROOT_INO, b"a/b") == errno.EINVAL
    gone = s.mkdir(ROOT_INO, b"gone", 0o755, 0, 0).ino
    s.rmdir(ROOT_INO, b"gone")
    assert _errno(run, s.link, f, gone, b"x") == errno.ENOENT
    handle = run(s.open, f, os.O_RDONLY)     # an unlinked file (open) gets no name again
    s.unlink(ROOT_INO, b"f")
    assert _errno(run, s.link, f, ROOT_INO, b"again") == errno.ENOENT
    s.release(handle.fh)
    # symlinks and special files have hard links too
    link = s.symlink(ROOT_INO, b"l", b"t", 0, 0)
    run(s.link, link.ino, d, b"l2")
    fifo = s.mknod(ROOT_INO, b"p", stat.S_IFIFO | 0o644, 0, 0, 0)
    run(s.link, fifo.ino, d, b"p2")
    assert link.nlink == fifo.nlink == 2 and s.readlink(s.lookup(d, b"l2").ino) == b"t"
    ctime = fifo.ctime_ns
    s.ns.clock = lambda: ctime + 10
    run(s.link, fifo.ino, d, b"p3")
    assert fifo.nlink == 3 and fifo.ctime_ns == ctime + 10     # a link changes the inode
    h.check_consistency()


def test_rename_moves_one_name_of_several(harness):
    h = harness()
    s = h.store
    run(h.put, "/a", b"aaa")
    run(h.put, "/other", b"ooo")
    a = s.ns.resolve("/a")
    run(s.link, a.ino, ROOT_INO, b"b")
    s.rename(ROOT_INO, b"a", ROOT_INO, b"c")                    # one name moves
    assert _names(s, "/b") == ["/b", "/c"] and a.nlink == 2
    s.rename(ROOT_INO, b"b", ROOT_INO, b"c")                    # onto its own other name:
    assert _names(s, "/b") == ["/b", "/c"]                     # nothing happens (POSIX)
    s.rename(ROOT_INO, b"other", ROOT_INO, b"b")                # replaces one of its names
    assert _names(s, "/c") == ["/c"] and a.nlink == 1
    assert run(h.get, "/b") == b"ooo" and run(h.get, "/c") == b"aaa"
    h.check_consistency()


def test_the_cache_removing_the_object_removes_every_name(harness):
    """No name may point at bytes that are gone: eviction (here DRAM without NVMe) and the
    operator's evict take every name, and hosts hear of each."""
    h = harness(dram=8 * MiB, nvme=0, marks=(0.99, 0.5))
    s = h.store
    run(h.put, "/d/a.bin", pattern("a", 4 * MiB))
    a = s.ns.resolve("/d/a.bin")
    run(s.link, a.ino, ROOT_INO, b"a-link")
    run(s.link, a.ino, s.ns.resolve("/d").ino, b"a2")
    run(h.put, "/b.bin", pattern("b", 4 * MiB))
    run(h.put, "/c.bin", pattern("c", 4 * MiB))   # a.bin, least recently used, goes
    for path in ("/d/a.bin", "/a-link", "/d/a2"):
        assert _errno(s.ns.resolve, path) == errno.ENOENT
    assert a.ino not in s.ns.inodes
    removed = sorted(f["name"] for e, f in h.events if e == "removed" and f["ino"] == a.ino)
    assert removed == [b"a-link", b"a.bin", b"a2"]
    b = s.ns.resolve("/b.bin")
    run(s.link, b.ino, ROOT_INO, b"b-link")
    h.events.clear()
    assert s.evict("/b-link") == {"removed": 1, "skipped_open": 0}
    assert sorted(f["name"] for _, f in h.events) == [b"b-link", b"b.bin"]
    assert s.evict("/") == {"removed": 1, "skipped_open": 0}    # c.bin: counted once each
    h.check_consistency()


def test_an_inode_with_no_name_left_lives_while_used(harness):
    h = harness()
    s = h.store
    run(h.put, "/a", b"data")
    a = s.ns.resolve("/a")
    run(s.link, a.ino, ROOT_INO, b"b")
    s.reference(a.ino)
    s.unlink(ROOT_INO, b"a")
    s.unlink(ROOT_INO, b"b")
    assert a.nlink == 0 and a.ino in s.ns.inodes
    s.unreference(a.ino)
    assert a.ino not in s.ns.inodes
    h.check_consistency()


def test_a_tmp_file_is_one_whose_every_name_is_tmp(harness):
    h = harness()
    s = h.store
    run(h.put, "/x.tmp", b"partial")
    x = s.ns.resolve("/x.tmp")
    assert x.ino in s.tmp_inos
    run(s.link, x.ino, ROOT_INO, b"x.bin")
    assert x.ino not in s.tmp_inos
    s.clock = lambda: 1 << 62
    assert run(s.collect_orphans) == 0
    s.unlink(ROOT_INO, b"x.bin")
    assert x.ino in s.tmp_inos
    assert run(s.collect_orphans) == 1


def _state(store) -> dict:
    """path -> (inode, nlink) of every file and symlink."""
    out = {}
    for node in list(store.ns.inodes.values()):
        if not node.is_dir:
            for path in _names(store, store.ns.path_of(node).decode() or "/"):
                out[path] = (node.ino, node.nlink)
    return out


@pytest.mark.parametrize("clean", [True, False], ids=["sigterm", "sigkill"])
def test_names_survive_restarts(harness, clean):
    """Every change of names of a persisted inode is journaled (NAMES while it has several,
    MOVE once it has one again, DROP when it has none); a clean stop's snapshot lists them
    after every directory they are in."""
    h = harness()
    s = h.store

    def make(path, data=b"content"):
        run(h.put, path, data)
        return s.ns.resolve(path).ino

    async def written_behind():
        await h.settle()

    one = make("/z/one")                              # persisted, then linked: NAMES
    run(written_behind)
    run(s.link, one, s.mkdir(ROOT_INO, b"a", 0o755, 0, 0).ino, b"one-a")
    run(s.link, one, ROOT_INO, b"one-root")
    late = s.mkdir(s.ns.resolve("/z").ino, b"late", 0o755, 0, 0).ino
    run(s.link, one, late, b"one-late")               # a directory made after the file
    s.unlink(s.ns.resolve("/z").ino, b"one")          # its first name goes
    two = make("/two")                                # linked before write-behind: FILE+NAMES
    run(s.link, two, ROOT_INO, b"two-b")
    three = make("/three")                            # 2 names, back to one: MOVE
    run(s.link, three, ROOT_INO, b"three-b")
    run(written_behind)
    s.unlink(ROOT_INO, b"three")
    four = make("/four")                              # a name replaced by a rename
    run(s.link, four, ROOT_INO, b"four-b")
    make("/mover")
    run(written_behind)
    s.rename(ROOT_INO, b"mover", ROOT_INO, b"four-b")
    five = make("/five")                              # one name renamed
    run(s.link, five, ROOT_INO, b"five-b")
    run(written_behind)
    s.rename(ROOT_INO, b"five", s.ns.resolve("/a").ino, b"five-moved")
    sym = s.symlink(ROOT_INO, b"sym", b"t", 0, 0).ino   # a symlink with two names
    run(s.link, sym, late, b"sym2")
    seven = make("/seven")                            # modified after linking: both gone
    run(s.link, seven, ROOT_INO, b"seven-b")
    six = make("/six")                                # a dirty file takes one of its names
    run(s.link, six, ROOT_INO, b"six-b")
    run(written_behind)
    handle = run(s.open, seven, os.O_WRONLY)
    run(h.write, handle.fh, 0, b"new")
    s.release(handle.fh)
    make("/dirty-mover")
    s.rename(ROOT_INO, b"dirty-mover", ROOT_INO, b"six-b")
    want = _state(s)
    assert want["/a/one-a"] == (one, 3) and want["/two-b"] == (two, 2)
    assert want["/three-b"] == (three, 1) and want["/four"] == (four, 1)
    assert want["/six"] == (six, 1) and want["/sym"] == (sym, 2)
    if not clean:   # what a kill loses: content only DRAM held (both names of seven)
        for path in ("/six-b", "/seven", "/seven-b"):
            del want[path]
    for restart in (clean, True, False):
        h.reopen(clean=restart)
        s = h.store
        assert _state(s) == want
        h.check_consistency()
    assert run(h.get, "/z/late/one-late") == b"content"


def test_names_records_replay(harness):
    ns = Namespace(lambda: 99)
    f = stat.S_IFREG | 0o644
    index.replay(ns, [
        (index.DIR, 2, ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0, 1, 1, 1),
        (index.FILE, 5, ROOT_INO, b"a", f, 0, 0, 1, 1, 1, 3, 0, 0, b""),
        (index.FILE, 6, ROOT_INO, b"x", f, 0, 0, 1, 1, 1, 3, 0, 0, b""),
        (index.NAMES, 5, [[ROOT_INO, b"a"], [2, b"b"], [ROOT_INO, b"x"]]),   # takes x from 6
        (index.NAMES, 5, [[2, b"b"], [77, b"nowhere"]]),                     # a bad one: gone
        (index.NAMES, 5, "junk"),
        (index.NAMES, 2, [[ROOT_INO, b"d2"]]),                                # a directory
    ])
    assert 6 not in ns.inodes and ns.inodes[5].names() == [(2, b"b")]
    assert ns.inodes[5].nlink == 1 and sorted(ns.inodes[ROOT_INO].children) == [b"d"]
