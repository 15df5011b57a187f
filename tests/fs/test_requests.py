"""The kernel's requests and what Operations answers, over an in-memory cache."""

import errno
import os
import stat

import pyfuse3
import pytest
from fake_kernel import ROOT, TIMEOUTS, ctx, setattr_fields
from memory_cache import RENAME_EXCHANGE, RENAME_NOREPLACE

MiB = 1 << 20


def _errno(kernel, handler, *args) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call(handler, *args)
    return e.value.errno


def test_create_write_read_back(kernel, cache):
    info, entry = kernel.create(ROOT, b"block.bin", 0o640)
    assert stat.S_ISREG(entry.st_mode) and stat.S_IMODE(entry.st_mode) == 0o640
    assert entry.st_size == 0 and entry.st_nlink == 1
    assert kernel.call("write", info.fh, 0, b"hello") == 5
    assert kernel.call("write", info.fh, 5, b", world") == 7
    assert kernel.call("read", info.fh, 0, 100) == b"hello, world"
    assert kernel.call("read", info.fh, 7, 3) == b"wor"
    kernel.call("flush", info.fh)
    kernel.call("fsync", info.fh, False)
    kernel.call("release", info.fh)
    assert cache.handles == {}

    again = kernel.lookup(ROOT, b"block.bin")
    assert again.st_ino == entry.st_ino
    assert again.st_size == 12
    assert kernel.call("getattr", entry.st_ino, ctx()).st_size == 12


def test_entries_carry_the_timeouts_and_block_counts(kernel):
    _, entry = kernel.create(ROOT, b"f")
    assert (entry.entry_timeout, entry.attr_timeout) == (TIMEOUTS.entry, TIMEOUTS.attr)
    assert entry.generation == 0
    assert entry.st_blksize == MiB
    ino = entry.st_ino
    kernel.call("setattr", ino, _attrs(st_size=513), setattr_fields(update_size=True), None,
                ctx())
    assert kernel.call("getattr", ino, ctx()).st_blocks == 2   # 512-byte units, rounded up
    link = kernel.symlink(ROOT, b"l", b"f")
    assert link.st_size == 1 and link.st_blocks == 0   # the target lives in the index


def test_files_are_direct_io_without_page_cache(kernel):
    info, entry = kernel.create(ROOT, b"f")
    assert info.direct_io and not info.keep_cache
    kernel.call("release", info.fh)
    info = kernel.call("open", entry.st_ino, os.O_RDONLY, ctx())
    assert info.direct_io and not info.keep_cache


def test_a_miss_is_a_negative_entry_the_kernel_may_cache(kernel, ops, cache):
    entry = kernel.lookup(ROOT, b"nothing")
    assert entry.st_ino == 0
    assert entry.entry_timeout == TIMEOUTS.negative
    assert ops.lookups == {} and not cache.refs


def test_open_truncates_and_reads_what_is_there(kernel):
    ino = kernel.write_file(ROOT, b"f", b"x" * 100)
    info = kernel.call("open", ino, os.O_RDONLY, ctx())
    assert kernel.call("read", info.fh, 90, 100) == b"x" * 10
    kernel.call("release", info.fh)
    info = kernel.call("open", ino, os.O_WRONLY | os.O_TRUNC, ctx())
    kernel.call("release", info.fh)
    assert kernel.call("getattr", ino, ctx()).st_size == 0


def test_setattr_passes_only_the_fields_the_kernel_set(kernel, cache):
    ino = kernel.write_file(ROOT, b"f", b"0123456789")
    entry = kernel.call("setattr", ino, _attrs(st_size=4, st_mode=stat.S_IFREG | 0o600,
                                               st_uid=7, st_mtime_ns=5_000),
                        setattr_fields(update_size=True, update_mode=True, update_mtime=True),
                        None, ctx())
    assert entry.st_size == 4
    assert stat.S_IMODE(entry.st_mode) == 0o600 and stat.S_ISREG(entry.st_mode)
    assert entry.st_uid == 0   # update_uid was not set: st_uid is not passed on
    assert entry.st_mtime_ns == 5_000
    assert bytes(cache.nodes[ino].data) == b"0123"


def test_mkdir_and_listing(kernel):
    d = kernel.mkdir(ROOT, b"dir").st_ino
    for name in (b"a", b"b", b"c"):
        kernel.write_file(d, name, name * 3)
    listing = kernel.readdir(d)
    assert [(name, attr.st_ino) for name, attr, _ in listing[:2]] == [(b".", d), (b"..", ROOT)]
    assert [name for name, _, _ in listing[2:]] == [b"a", b"b", b"c"]
    assert all(attr.st_size == 3 for _, attr, _ in listing[2:])
    # offsets: . and .. at 1 and 2, each entry after them; a page of any size resumes there
    assert [offset for _, _, offset in listing] == [1, 2, 3, 4, 5]
    for room in (1, 2, 4):
        assert kernel.list_all(d, room) == [b".", b"..", b"a", b"b", b"c"]


def test_a_listing_offset_stays_valid_while_entries_go(kernel):
    d = kernel.mkdir(ROOT, b"dir").st_ino
    for name in (b"a", b"b", b"c", b"d"):
        kernel.write_file(d, name, b"")
    first = kernel.readdir(d, 0, room=4)   # ., .., a, b
    kernel.call("unlink", d, b"a", ctx())
    kernel.call("unlink", d, b"c", ctx())
    rest = kernel.readdir(d, first[-1][2])
    assert [name for name, _, _ in rest] == [b"d"]


def test_rename_moves_and_replaces(kernel, cache):
    a = kernel.write_file(ROOT, b"a", b"new")
    b = kernel.write_file(ROOT, b"b", b"old")
    kernel.call("rename", ROOT, b"a", ROOT, b"b", 0, ctx())
    assert kernel.lookup(ROOT, b"a").st_ino == 0
    assert kernel.lookup(ROOT, b"b").st_ino == a
    assert b not in cache.nodes   # the replaced file had no other name and no open handle

    d = kernel.mkdir(ROOT, b"d").st_ino
    kernel.call("rename", ROOT, b"b", d, b"moved", 0, ctx())
    assert kernel.lookup(d, b"moved").st_ino == a
    assert kernel.list_all(ROOT) == [b".", b"..", b"d"]


def test_rename_flags_reach_the_cache(kernel):
    kernel.write_file(ROOT, b"a", b"1")
    kernel.write_file(ROOT, b"b", b"2")
    assert _errno(kernel, "rename", ROOT, b"a", ROOT, b"b", RENAME_NOREPLACE, ctx()) == \
        errno.EEXIST
    assert _errno(kernel, "rename", ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE, ctx()) == \
        errno.EINVAL
    assert _errno(kernel, "rename", ROOT, b"gone", ROOT, b"c", 0, ctx()) == errno.ENOENT


def test_unlink_and_rmdir(kernel):
    kernel.write_file(ROOT, b"f", b"x")
    d = kernel.mkdir(ROOT, b"d").st_ino
    kernel.write_file(d, b"inner", b"y")
    assert _errno(kernel, "rmdir", ROOT, b"d", ctx()) == errno.ENOTEMPTY
    assert _errno(kernel, "unlink", ROOT, b"d", ctx()) == errno.EISDIR
    assert _errno(kernel, "rmdir", ROOT, b"f", ctx()) == errno.ENOTDIR
    kernel.call("unlink", d, b"inner", ctx())
    kernel.call("rmdir", ROOT, b"d", ctx())
    kernel.call("unlink", ROOT, b"f", ctx())
    assert _errno(kernel, "unlink", ROOT, b"f", ctx()) == errno.ENOENT
    assert kernel.list_all(ROOT) == [b".", b".."]


def test_an_unlinked_file_stays_readable_through_its_open_handle(kernel, cache):
    ino = kernel.write_file(ROOT, b"f", b"still here")
    info = kernel.call("open", ino, os.O_RDONLY, ctx())
    kernel.call("unlink", ROOT, b"f", ctx())
    assert kernel.lookup(ROOT, b"f").st_ino == 0
    assert kernel.call("read", info.fh, 0, 100) == b"still here"
    kernel.call("release", info.fh)
    assert ino not in cache.nodes


def test_symlink_link_and_special_files(kernel, cache):
    ino = kernel.write_file(ROOT, b"f", b"data")
    link = kernel.symlink(ROOT, b"l", b"f")
    assert stat.S_ISLNK(link.st_mode)
    assert kernel.call("readlink", link.st_ino, ctx()) == b"f"
    assert _errno(kernel, "readlink", ino, ctx()) == errno.EINVAL

    hard = kernel.link(ino, ROOT, b"h")
    assert hard.st_ino == ino and hard.st_nlink == 2

    fifo = kernel.mknod(ROOT, b"p", stat.S_IFIFO | 0o600)
    assert stat.S_ISFIFO(fifo.st_mode)
    dev = kernel.mknod(ROOT, b"c", stat.S_IFCHR | 0o600, rdev=os.makedev(1, 3))
    assert dev.st_rdev == os.makedev(1, 3)
    # a regular file made with mknod is a create whose handle Operations closes itself
    calls = len(cache.calls)
    reg = kernel.mknod(ROOT, b"r", stat.S_IFREG | 0o644)
    assert stat.S_ISREG(reg.st_mode)
    assert cache.calls[calls:] == ["create", "release"]
    assert cache.handles == {}


def test_statfs(kernel, cache):
    s = kernel.call("statfs", ctx())
    assert (s.f_bsize, s.f_frsize, s.f_blocks, s.f_bfree, s.f_bavail) == \
        (MiB, MiB, 1024, 1000, 1000)
    assert s.f_favail == s.f_ffree == (1 << 20) - len(cache.nodes)
    assert s.f_namemax == 255


@pytest.mark.parametrize("handler, args", [
    ("getxattr", (ROOT, b"user.x", None)),
    ("setxattr", (ROOT, b"user.x", b"v", None)),
    ("listxattr", (ROOT, None)),
    ("removexattr", (ROOT, b"user.x", None)),
])
def test_extended_attributes_are_not_supported(kernel, cache, handler, args):
    assert _errno(kernel, handler, *args) == errno.ENOTSUP
    assert cache.calls == []


def _attrs(**values) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    for key, value in values.items():
        setattr(a, key, value)
    return a
