"""Lookup counts: every entry the kernel is given is a reference it later forgets. Operations
counts them (`lookups`, for invalidation after a daemon restart) and passes FORGET on to the
cache, which keeps a removed file openable while the kernel holds it: both counts must agree
with the kernel's."""

import errno
import os
import stat
from collections import Counter
from unittest import mock

import pyfuse3
import pytest
from fake_kernel import ROOT


def _agree(kernel, ops, cache) -> None:
    assert Counter(ops.lookups) == kernel.held
    assert cache.refs == kernel.held


def test_each_kind_of_entry_is_one_reference(kernel, ops, cache):
    d = kernel.mkdir(ROOT, b"d").st_ino
    _, f = kernel.create(d, b"f")
    kernel.symlink(d, b"l", b"f")
    kernel.link(f.st_ino, d, b"h")
    kernel.mknod(d, b"p", stat.S_IFIFO | 0o600)
    kernel.mknod(d, b"r", stat.S_IFREG | 0o600)
    kernel.lookup(d, b"f")
    kernel.lookup(d, b"f")
    assert ops.lookups[f.st_ino] == 4   # create, link, two lookups
    assert ops.lookups[d] == 1
    _agree(kernel, ops, cache)


def test_forget_gives_back_what_the_kernel_drops(kernel, ops, cache):
    _, f = kernel.create(ROOT, b"f")
    for _ in range(3):
        kernel.lookup(ROOT, b"f")
    kernel.forget({f.st_ino: 2})
    assert ops.lookups == {f.st_ino: 2}
    _agree(kernel, ops, cache)
    kernel.forget_all()
    assert ops.lookups == {} and not cache.refs


def test_misses_and_failures_are_no_reference(kernel, ops, cache):
    kernel.write_file(ROOT, b"f", b"")
    kernel.forget_all()
    kernel.lookup(ROOT, b"absent")
    with pytest.raises(pyfuse3.FUSEError):
        kernel.create(ROOT, b"f", flags=os.O_RDWR | os.O_CREAT | os.O_EXCL)
    with pytest.raises(pyfuse3.FUSEError):
        kernel.mkdir(ROOT, b"f")
    cache.fail("lookup", OSError(errno.ETIMEDOUT, "no answer"))
    with pytest.raises(pyfuse3.FUSEError):
        kernel.lookup(ROOT, b"f")
    assert ops.lookups == {} and not cache.refs


@pytest.mark.parametrize("room", [1, 2, 3, 5, None])
def test_readdirplus_entries_not_taken_go_back_to_the_cache(kernel, ops, cache, room):
    """The cache counts every entry it lists; the kernel takes as many as fit its buffer.
    `.` and `..` are no reference (the kernel links no dentry for them)."""
    d = kernel.mkdir(ROOT, b"d").st_ino
    for i in range(7):
        kernel.write_file(d, f"e{i}".encode(), b"")
    kernel.forget_all()
    assert kernel.list_all(d, room)[2:] == [f"e{i}".encode() for i in range(7)]
    assert sum(kernel.held.values()) == 7
    _agree(kernel, ops, cache)
    kernel.forget_all()
    assert ops.lookups == {} and not cache.refs


def test_a_forget_the_cache_cannot_take_is_still_counted(kernel, ops, cache, caplog):
    """FORGET has no reply: a failure to deliver it leaves nothing to tell the kernel."""
    _, f = kernel.create(ROOT, b"f")
    cache.fail("forget", OSError(errno.ETIMEDOUT, "no answer"))
    kernel.forget_all()   # raises nothing
    assert ops.lookups == {}
    assert cache.refs == {f.st_ino: 1}   # the daemon never heard


def test_forget_everything_invalidates_each_inode_the_kernel_holds(kernel, ops):
    """After a daemon restart the attributes the kernel holds may describe files that are
    gone; an inode the kernel already dropped is no error."""
    inos = [kernel.write_file(ROOT, name, b"") for name in (b"a", b"b", b"c")]
    kernel.forget({inos[1]: 1})
    invalidated = []

    def invalidate_inode(ino, attr_only):
        invalidated.append((ino, attr_only))
        if ino == inos[2]:
            raise FileNotFoundError(errno.ENOENT, "dropped")

    with mock.patch.object(pyfuse3, "invalidate_inode", invalidate_inode):
        ops.forget_everything()
    assert sorted(invalidated) == [(inos[0], True), (inos[2], True)]


def test_forget_name_invalidates_the_kernels_entry(ops):
    with mock.patch.object(pyfuse3, "invalidate_entry_async") as invalidate:
        ops.forget_name(ROOT, b"evicted", 42)
    invalidate.assert_called_once_with(ROOT, b"evicted", deleted=42, ignore_enoent=True)

