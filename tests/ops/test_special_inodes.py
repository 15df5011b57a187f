"""Symlinks, FIFOs, sockets and device nodes in the store (no sockets, no kernel): inodes with
attributes only, in the index, never in a tier; and what `..` names in a listing."""

import errno
import os
import stat

import pytest

from bluecached.namespace import ROOT_INO, SYMLINK_MAX, FsError, Namespace
from bluecached.tiers import index
from support import MiB, pattern, run

FIFO = stat.S_IFIFO | 0o640
SOCK = stat.S_IFSOCK | 0o755
CHR = stat.S_IFCHR | 0o620
BLK = stat.S_IFBLK | 0o660
RDEV = os.makedev(8, 17)


def _errno(fn, *args, **kw) -> int:
    with pytest.raises(FsError) as e:
        fn(*args, **kw)
    return e.value.errno


def _describe(store, path: str) -> tuple:
    n = store.ns.resolve(path)
    # a rename's ctime is not journaled (MOVE names the place only, for every kind of inode):
    # after a kill, a moved inode has the ctime of its last other change
    moved = path in ("/after", "/d/replaced.bin")
    return (n.ino, n.mode, n.uid, n.gid, n.size, n.rdev, n.target, n.nlink,
            n.atime_ns, n.mtime_ns, None if moved else n.ctime_ns)


def _make_tree(h) -> None:
    """One of each kind, a few of them changed after they were made."""
    s = h.store
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    run(h.put, "/d/file.bin", pattern("f", 3 * MiB))
    s.symlink(d, b"rel", b"file.bin", 1000, 1000)
    s.symlink(ROOT_INO, b"abs", b"/mnt/kv/d/file.bin", 0, 0)
    s.symlink(d, b"dangling", b"nowhere/\xffbytes", 5, 6)
    s.mknod(d, b"fifo", FIFO, 0, 7, 8)
    s.mknod(d, b"sock", SOCK, 0, 0, 0)
    s.mknod(d, b"tty", CHR, os.makedev(4, 1), 0, 5)
    s.mknod(ROOT_INO, b"disk", BLK, RDEV, 0, 6)
    s.symlink(d, b"gone", b"x", 0, 0)
    s.unlink(d, b"gone")
    s.symlink(d, b"before", b"t", 0, 0)
    s.rename(d, b"before", ROOT_INO, b"after")              # moved
    s.symlink(d, b"over", b"file.bin", 0, 0)
    run(h.put, "/d/replaced.bin", b"old bytes")
    s.rename(d, b"over", d, b"replaced.bin")                # replaces a file
    run(lambda: s.setattr(s.ns.resolve("/d/fifo").ino, mode=0o600, uid=9, gid=10,
                          atime_ns=11, mtime_ns=12))        # chmod, chown, utimes
    run(lambda: s.setattr(s.ns.resolve("/abs").ino, uid=3, gid=4, mtime_ns=13))   # lchown


TREE = ["/d/rel", "/abs", "/d/dangling", "/d/fifo", "/d/sock", "/d/tty", "/disk", "/after",
        "/d/replaced.bin"]


def test_symlinks_and_special_files_are_inodes_with_attributes_only(harness):
    h = harness()
    s = h.store
    _make_tree(h)
    link = s.ns.resolve("/d/rel")
    assert stat.S_ISLNK(link.mode) and stat.S_IMODE(link.mode) == 0o777
    assert (link.size, link.uid, link.gid, link.nlink) == (8, 1000, 1000, 1)
    assert s.readlink(link.ino) == b"file.bin"
    assert s.readlink(s.ns.resolve("/d/dangling").ino) == b"nowhere/\xffbytes"
    assert s.readlink(s.ns.resolve("/d/replaced.bin").ino) == b"file.bin"
    fifo = s.ns.resolve("/d/fifo")
    assert (fifo.mode, fifo.uid, fifo.gid, fifo.size, fifo.rdev) == (
        stat.S_IFIFO | 0o600, 9, 10, 0, 0)
    assert (fifo.atime_ns, fifo.mtime_ns) == (11, 12)
    assert stat.S_ISSOCK(s.ns.resolve("/d/sock").mode)
    assert s.ns.resolve("/d/tty").attrs()["rdev"] == os.makedev(4, 1)
    assert s.ns.resolve("/disk").attrs()["rdev"] == RDEV
    for path in TREE:
        node = s.ns.resolve(path)
        assert node.is_meta and node.obj is None
        assert s.tier_of(node) == "index"
    # none of them is a file to open, read or truncate
    assert _errno(run, s.open, link.ino, os.O_RDONLY) == errno.ELOOP
    assert _errno(run, s.open, fifo.ino, os.O_RDONLY) == errno.ENXIO
    assert _errno(run, lambda: s.setattr(fifo.ino, size=0)) == errno.EINVAL
    assert _errno(s.readlink, fifo.ino) == errno.EINVAL
    assert _errno(s.readlink, s.ns.resolve("/d/file.bin").ino) == errno.EINVAL
    assert _errno(s.readlink, ROOT_INO) == errno.EINVAL
    # nor does the object's bookkeeping count them
    assert s.logical_bytes == 3 * MiB
    assert s.usage("/") == {"files": 1, "dirs": 2, "other": 9, "bytes": 3 * MiB,
                            "dram_bytes": 3 * MiB, "nvme_bytes": 0, "dirty": 1}
    h.check_consistency()


def test_creation_rules(harness):
    s = harness().store
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    s.symlink(d, b"l", b"t" * SYMLINK_MAX, 0, 0)                          # PATH_MAX with NUL
    assert s.ns.resolve("/d/l").size == SYMLINK_MAX == 4095
    assert _errno(s.symlink, d, b"m", b"t" * (SYMLINK_MAX + 1), 0, 0) == errno.ENAMETOOLONG
    assert _errno(s.symlink, d, b"m", b"", 0, 0) == errno.ENOENT
    assert _errno(s.symlink, d, b"m", b"a\0b", 0, 0) == errno.EINVAL
    assert _errno(s.symlink, d, b"l", b"t", 0, 0) == errno.EEXIST
    assert _errno(s.symlink, d, b"n" * 256, b"t", 0, 0) == errno.ENAMETOOLONG
    assert _errno(s.mknod, d, b"l", FIFO, 0, 0, 0) == errno.EEXIST
    assert _errno(s.mknod, d, b"f", stat.S_IFREG | 0o644, 0, 0, 0) == errno.EINVAL
    assert _errno(s.mknod, d, b"f", stat.S_IFDIR | 0o755, 0, 0, 0) == errno.EINVAL
    assert _errno(s.mknod, d, b"f", stat.S_IFLNK | 0o777, 0, 0, 0) == errno.EINVAL
    assert _errno(s.symlink, 12345, b"x", b"t", 0, 0) == errno.ESTALE     # no such inode
    link = s.ns.resolve("/d/l").ino
    assert _errno(s.symlink, link, b"x", b"t", 0, 0) == errno.ENOTDIR
    assert _errno(s.rmdir, d, b"l") == errno.ENOTDIR
    assert _errno(s.rmdir, ROOT_INO, b"d") == errno.ENOTEMPTY
    # a FIFO's permission bits are the caller's, its type stays
    fifo = s.mknod(d, b"p", stat.S_IFIFO | 0o4777, 0, 0, 0)
    assert fifo.mode == stat.S_IFIFO | 0o4777
    run(lambda: s.setattr(fifo.ino, mode=0o600))
    assert fifo.mode == stat.S_IFIFO | 0o600


@pytest.mark.parametrize("clean", [True, False], ids=["sigterm", "sigkill"])
def test_they_survive_restarts(harness, clean):
    """A clean stop snapshots them; a killed daemon's journal replays them."""
    h = harness()
    _make_tree(h)
    before = {p: _describe(h.store, p) for p in TREE}
    run(h.settle)
    for restart in (clean, True, False):   # and again after being replayed or snapshotted
        h.reopen(clean=restart)
        assert {p: _describe(h.store, p) for p in TREE} == before
        with pytest.raises(FsError):
            h.store.ns.resolve("/d/gone")
        with pytest.raises(FsError):
            h.store.ns.resolve("/d/before")
        assert h.store.readlink(h.store.ns.resolve("/d/rel").ino) == b"file.bin"
        assert run(h.get, "/d/file.bin") == pattern("f", 3 * MiB)
        h.check_consistency()


def test_the_journal_records_them_as_node_records(harness):
    h = harness()
    s = h.store
    link = s.symlink(ROOT_INO, b"l", b"target", 1, 2)
    fifo = s.mknod(ROOT_INO, b"p", FIFO, 0, 0, 0)
    records = h.store._snapshot()
    assert index.node_record(link) in records and index.node_record(fifo) in records
    assert index.node_record(link)[0] == index.NODE == "N"
    assert index.node_record(link)[-2:] == (0, b"target")
    assert index.node_record(fifo)[-2:] == (0, None)
    # damaged records are skipped, never half applied
    ns = Namespace(lambda: 99)
    bad = [(index.NODE, 5, ROOT_INO, b"a", stat.S_IFLNK | 0o777, 0, 0, 1, 1, 1, 0, None),
           (index.NODE, 6, ROOT_INO, b"b", stat.S_IFIFO | 0o644, 0, 0, 1, 1, 1, 0, b"t"),
           (index.NODE, 7, ROOT_INO, b"c", stat.S_IFREG | 0o644, 0, 0, 1, 1, 1, 0, None),
           (index.NODE, ROOT_INO, ROOT_INO, b"d", FIFO, 0, 0, 1, 1, 1, 0, None),
           (index.NODE, 8, ROOT_INO, b"e", FIFO, 0, 0, 1, 1, 1)]
    replayed = index.replay(ns, bad)
    assert replayed.skipped == len(bad)
    assert list(ns.inodes) == [ROOT_INO] and not ns.inodes[ROOT_INO].children
    # a NODE record for an inode that was a file drops the file first
    ns = Namespace(lambda: 99)
    index.replay(ns, [
        (index.FILE, 5, ROOT_INO, b"a", stat.S_IFREG | 0o644, 0, 0, 1, 1, 1, 3, 0, 0, b""),
        (index.NODE, 5, ROOT_INO, b"a", FIFO, 0, 0, 1, 1, 1, 0, None)])
    assert stat.S_ISFIFO(ns.resolve("/a").mode)


def test_the_cache_never_evicts_them(harness):
    """They cost the tiers nothing: eviction (by watermarks, by the operator, a checksum
    failure, orphaned .tmp collection) passes them by; a link to an evicted file dangles."""
    h = harness(dram=8 * MiB, nvme=0, marks=(0.99, 0.5))
    s = h.store
    s.symlink(ROOT_INO, b"to-a", b"a.bin", 0, 0)
    s.symlink(ROOT_INO, b"x.tmp", b"a.bin", 0, 0)
    s.mknod(ROOT_INO, b"p.tmp", FIFO, 0, 0, 0)
    s.mknod(ROOT_INO, b"p", FIFO, 0, 0, 0)
    run(h.put, "/a.bin", pattern("a", 4 * MiB))
    run(h.put, "/b.bin", pattern("b", 4 * MiB))
    run(h.put, "/c.bin", pattern("c", 4 * MiB))   # pushes a.bin out: no tier below DRAM
    with pytest.raises(FsError):
        s.ns.resolve("/a.bin")
    assert s.readlink(s.ns.resolve("/to-a").ino) == b"a.bin"   # dangling now
    assert not s.tmp_inos
    s.clock = lambda: 1 << 62    # every .tmp is ancient
    assert run(s.collect_orphans) == 0
    assert s.evict("/") == {"removed": 2, "skipped_open": 0}
    for path in ("/to-a", "/x.tmp", "/p.tmp", "/p"):
        assert s.ns.resolve(path).is_meta
    assert [e for e, f in h.events if f["name"] in (b"to-a", b"x.tmp", b"p.tmp", b"p")] == []
    h.check_consistency()


def test_an_unlinked_one_lives_while_the_kernel_holds_it(harness):
    h = harness()
    s = h.store
    link = s.symlink(ROOT_INO, b"l", b"t", 0, 0)
    fifo = s.mknod(ROOT_INO, b"p", FIFO, 0, 0, 0)
    s.reference(link.ino)
    s.unlink(ROOT_INO, b"l")
    s.unlink(ROOT_INO, b"p")
    assert fifo.ino not in s.ns.inodes                       # nobody held it
    assert s.getattr(link.ino).nlink == 0 and s.readlink(link.ino) == b"t"
    s.unreference(link.ino)
    assert link.ino not in s.ns.inodes
    h.reopen(clean=False)
    assert list(h.store.ns.inodes) == [ROOT_INO]
    # replaced by rename: the same
    s = h.store
    a = s.symlink(ROOT_INO, b"a", b"1", 0, 0)
    s.symlink(ROOT_INO, b"b", b"2", 0, 0)
    s.rename(ROOT_INO, b"b", ROOT_INO, b"a")
    assert a.ino not in s.ns.inodes and s.readlink(s.lookup(ROOT_INO, b"a").ino) == b"2"
    h.reopen(clean=False)
    assert h.store.readlink(h.store.lookup(ROOT_INO, b"a").ino) == b"2"
    assert list(h.store.root().children) == [b"a"]


def test_dotdot_names_the_parent(harness):
    s = harness().store
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    e = s.mkdir(d, b"e", 0o755, 0, 0).ino
    assert (s.parent_of(ROOT_INO), s.parent_of(d), s.parent_of(e)) == (ROOT_INO, ROOT_INO, d)
    s.symlink(d, b"l", b"e", 0, 0)
    assert _errno(s.parent_of, s.lookup(d, b"l").ino) == errno.ENOTDIR
