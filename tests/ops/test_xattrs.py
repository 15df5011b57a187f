"""user.* extended attributes in the store (no sockets, no kernel): the rules and limits, what
rename, unlink and the tiers do to them, and what a restart (clean or killed) brings back."""

import errno
import inspect
import os
import stat

import pytest

from bluecached import xattrs
from bluecached.namespace import ROOT_INO, FsError
from support import MiB, pattern, run

CRC = b"user.vllm.kv_crc32c"


def _errno(fn, *args) -> int:
    with pytest.raises(FsError) as e:
        run(fn, *args) if inspect.iscoroutinefunction(fn) else fn(*args)
    return e.value.errno


def _ino(h, path: str) -> int:
    return h.store.ns.resolve(path).ino


def test_set_get_list_remove_and_the_flags(harness):
    h = harness()
    s = h.store
    run(h.put, "/a.bin", b"x" * 100)
    ino = _ino(h, "/a.bin")
    assert s.listxattr(ino) == []
    assert _errno(s.getxattr, ino, CRC) == errno.ENODATA
    run(s.setxattr, ino, CRC, b"1234")
    run(s.setxattr, ino, b"user.empty", b"")
    assert s.getxattr(ino, CRC) == b"1234" and s.getxattr(ino, b"user.empty") == b""
    assert s.listxattr(ino) == [CRC, b"user.empty"]
    assert _errno(s.setxattr, ino, CRC, b"9", xattrs.XATTR_CREATE) == errno.EEXIST
    assert _errno(s.setxattr, ino, b"user.new", b"9", xattrs.XATTR_REPLACE) == errno.ENODATA
    run(s.setxattr, ino, CRC, b"5678", xattrs.XATTR_REPLACE)
    run(s.setxattr, ino, b"user.new", b"9", xattrs.XATTR_CREATE)
    assert s.getxattr(ino, CRC) == b"5678"
    run(s.removexattr, ino, CRC)
    assert _errno(s.removexattr, ino, CRC) == errno.ENODATA
    assert s.listxattr(ino) == [b"user.empty", b"user.new"]
    # directories hold them too
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    run(s.setxattr, d.ino, b"user.dir", b"yes")
    assert s.getxattr(d.ino, b"user.dir") == b"yes"


def test_limits_and_namespaces(harness):
    h = harness()
    s = h.store
    run(h.put, "/a.bin", b"x")
    ino = _ino(h, "/a.bin")
    longest = b"user." + b"n" * 250
    run(s.setxattr, ino, longest, b"v")
    assert _errno(s.setxattr, ino, longest + b"n", b"v") == errno.ERANGE
    assert _errno(s.getxattr, ino, longest + b"n") == errno.ERANGE
    assert _errno(s.setxattr, ino, b"user.", b"v") == errno.EINVAL
    big = pattern("v", xattrs.VALUE_MAX)
    run(s.setxattr, ino, b"user.big", big)            # 64 KiB: held
    assert s.getxattr(ino, b"user.big") == big
    assert _errno(s.setxattr, ino, b"user.big", big + b"!") == errno.E2BIG
    run(s.setxattr, ino, b"user.big2", big[:-4096])   # near the total, still within
    assert _errno(s.setxattr, ino, b"user.big3", big[:8192]) == errno.ENOSPC
    run(s.removexattr, ino, b"user.big2")
    run(s.setxattr, ino, b"user.big3", big[:8192])    # room again
    for name in (b"trusted.a", b"security.capability", b"system.posix_acl_access", b"os2.x"):
        assert _errno(s.setxattr, ino, name, b"v") == errno.EOPNOTSUPP
        assert _errno(s.getxattr, ino, name) == errno.EOPNOTSUPP
        assert _errno(s.removexattr, ino, name) == errno.EOPNOTSUPP


def test_symlinks_and_special_files_refuse_user_attributes_as_ext4(harness):
    h = harness()
    s = h.store
    link = s.symlink(ROOT_INO, b"l", b"target", 0, 0)
    fifo = s.mknod(ROOT_INO, b"f", stat.S_IFIFO | 0o644, 0, 0, 0)
    for node in (link, fifo):
        assert _errno(s.setxattr, node.ino, CRC, b"v") == errno.EPERM
        assert _errno(s.removexattr, node.ino, CRC) == errno.EPERM
        assert _errno(s.getxattr, node.ino, CRC) == errno.ENODATA
        assert s.listxattr(node.ino) == []


def test_kept_across_rename_and_rename_over_and_dropped_with_the_file(harness):
    h = harness()
    s = h.store
    run(h.put, "/blk.bin", b"old")
    run(s.setxattr, _ino(h, "/blk.bin"), CRC, b"old-crc")
    run(s.setxattr, _ino(h, "/blk.bin"), b"user.only-old", b"1")
    # vLLM's sequence: tmp written, attribute set on it, renamed over the final name
    run(h.put, "/blk.bin_x.tmp", b"new")
    tmp = _ino(h, "/blk.bin_x.tmp")
    run(s.setxattr, tmp, CRC, b"new-crc")
    s.rename(ROOT_INO, b"blk.bin_x.tmp", ROOT_INO, b"blk.bin")
    node = s.ns.resolve("/blk.bin")
    assert node.ino == tmp
    assert s.listxattr(node.ino) == [CRC] and s.getxattr(node.ino, CRC) == b"new-crc"
    # a fresh file at a name that had attributes starts with none
    s.unlink(ROOT_INO, b"blk.bin")
    run(h.put, "/blk.bin", b"again")
    assert s.listxattr(_ino(h, "/blk.bin")) == []
    h.check_consistency()


@pytest.mark.parametrize("clean", [True, False], ids=["sigterm", "sigkill"])
def test_persisted_with_the_object_across_restarts(harness, clean):
    h = harness()
    s = h.store
    d = s.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    run(s.setxattr, d.ino, b"user.dir", b"D")
    run(h.put, "/d/early.bin", pattern("e", MiB))        # set before write-behind
    run(s.setxattr, _ino(h, "/d/early.bin"), CRC, b"early")
    run(h.put, "/d/late.bin", pattern("l", MiB))
    run(h.settle)                                        # both on NVMe now
    run(s.setxattr, _ino(h, "/d/late.bin"), CRC, b"late")   # set after write-behind
    run(s.setxattr, _ino(h, "/d/early.bin"), b"user.more", b"m")
    run(s.removexattr, _ino(h, "/d/early.bin"), CRC)
    s = h.reopen(clean=clean)
    assert s.getxattr(_ino(h, "/d"), b"user.dir") == b"D"
    assert s.listxattr(_ino(h, "/d/early.bin")) == [b"user.more"]
    assert s.getxattr(_ino(h, "/d/late.bin"), CRC) == b"late"
    assert run(h.get, "/d/late.bin") == pattern("l", MiB)
    s = h.reopen(clean=True)                              # and through a snapshot
    assert s.getxattr(_ino(h, "/d"), b"user.dir") == b"D"
    assert s.getxattr(_ino(h, "/d/late.bin"), CRC) == b"late"
    assert s.listxattr(_ino(h, "/d/early.bin")) == [b"user.more"]


def test_after_a_kill_a_file_never_comes_back_with_another_files_or_stale_attributes(harness):
    h = harness()
    s = h.store
    run(h.put, "/blk.bin", pattern("old", MiB))
    run(s.setxattr, _ino(h, "/blk.bin"), CRC, b"old-crc")
    run(h.settle)                       # the old block and its attribute are persisted
    # the new block is written behind too, then renamed over the old one
    run(h.put, "/blk.bin_1.tmp", pattern("new", MiB))
    run(s.setxattr, _ino(h, "/blk.bin_1.tmp"), CRC, b"new-crc")
    run(h.settle)
    s.rename(ROOT_INO, b"blk.bin_1.tmp", ROOT_INO, b"blk.bin")
    # a third version, modified in DRAM only: the kill loses it (absent, not older)
    run(h.put, "/other.bin", pattern("o1", MiB))
    run(s.setxattr, _ino(h, "/other.bin"), CRC, b"o1-crc")
    run(h.settle)
    handle = run(s.open, _ino(h, "/other.bin"), os.O_WRONLY)
    run(h.write, handle.fh, 0, pattern("o2", MiB))
    s.release(handle.fh)
    s = h.reopen(clean=False)
    assert run(h.get, "/blk.bin") == pattern("new", MiB)
    assert s.listxattr(_ino(h, "/blk.bin")) == [CRC]
    assert s.getxattr(_ino(h, "/blk.bin"), CRC) == b"new-crc"
    with pytest.raises(FsError):        # its persisted copy was dropped at the first write
        s.ns.resolve("/other.bin")


def test_moved_with_the_object_between_dram_and_nvme(harness):
    h = harness()
    s = h.store
    run(h.put, "/a.bin", pattern("a", 4 * MiB))
    run(s.setxattr, _ino(h, "/a.bin"), CRC, b"a-crc")
    run(h.settle)
    node = s.ns.resolve("/a.bin")
    s.tiers.drop_dram(node)              # what the evictor does to a clean object
    assert s.tier_of(node) == "nvme"
    assert s.getxattr(node.ino, CRC) == b"a-crc"
    assert run(h.get, "/a.bin") == pattern("a", 4 * MiB)     # promoted back
    assert s.tier_of(node) == "dram+nvme"
    assert s.getxattr(node.ino, CRC) == b"a-crc"
    h.check_consistency()


def test_a_failed_journal_append_leaves_the_attributes_unchanged(harness, monkeypatch):
    h = harness()
    s = h.store
    run(h.put, "/a.bin", b"x")
    run(h.settle)
    ino = _ino(h, "/a.bin")
    run(s.setxattr, ino, CRC, b"1")

    def full(*records):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(s.tiers.journal, "append_many", full)
    assert _errno(s.setxattr, ino, CRC, b"2") == errno.ENOSPC
    assert _errno(s.removexattr, ino, CRC) == errno.ENOSPC
    assert s.getxattr(ino, CRC) == b"1"
