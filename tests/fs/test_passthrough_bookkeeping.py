"""Passthrough's bookkeeping (fusefs/passthrough.py) through Operations: which opens get a
backing id, which keep FOPEN_DIRECT_IO, and that every fd and backing id is given back. A fake
shim stands in for the cffi module; the kernel's side is tests/mount/test_passthrough.py."""

import errno
import os
from types import SimpleNamespace

import pytest
from fake_kernel import ROOT, TIMEOUTS, Kernel, ctx

from fusefs import Operations
from fusefs.passthrough import Passthrough


class FakeShimLib:
    BC_PT_KERNEL_READS, BC_PT_DAEMON_IO, BC_PT_KERNEL_WRITES = 0, 1, 2

    def __init__(self, negotiated: int = 1):
        self.negotiated = negotiated
        self.next_id = 1
        self.open_ids: dict[int, tuple[int, int]] = {}   # backing id: the file it names
        self.closed: list[int] = []
        self.replies: dict[int, tuple[int, int]] = {}   # fh: (backing id, BC_PT_* mode)
        self.refuse_open = 0

    def bc_passthrough_state(self):
        return self.negotiated

    def bc_backing_open(self, fd):
        if self.refuse_open:
            return -self.refuse_open
        st = os.fstat(fd)
        backing_id, self.next_id = self.next_id, self.next_id + 1
        self.open_ids[backing_id] = (st.st_dev, st.st_ino)
        return backing_id

    def bc_backing_close(self, backing_id):
        self.closed.append(backing_id)
        return 0 if self.open_ids.pop(backing_id, None) else -errno.ENOENT

    def bc_passthrough_set(self, fh, backing_id, mode):
        self.replies[fh] = (backing_id, mode)
        return 0

    def bc_passthrough_clear(self, fh):
        self.replies.pop(fh, None)

    def bc_passthrough_opens(self):
        return len(self.replies)


@pytest.fixture
def shim():
    return SimpleNamespace(lib=FakeShimLib())


@pytest.fixture
def ops(cache, shim):
    return Operations(cache, TIMEOUTS, Passthrough(shim, grace=0))   # ids closed at release


@pytest.fixture
def kernel(ops):
    return Kernel(ops)


def _open(kernel, ino, flags=os.O_RDONLY):
    return kernel.call("open", ino, flags, ctx()).fh


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_read_only_open_gets_the_files_memfd_as_backing(kernel, ops, cache, shim):
    ino = kernel.write_file(ROOT, b"f", b"kv block")
    fh = _open(kernel, ino)
    backing_id, mode = shim.lib.replies[fh]
    assert mode == 0   # reads go to the backing file
    assert shim.lib.open_ids[backing_id] == ops.passthrough.inodes[ino].file
    memfd = cache.nodes[ino].memfd
    assert os.pread(memfd, 100, 0) == b"kv block"
    kernel.call("release", fh)
    assert shim.lib.closed == [backing_id] and not shim.lib.open_ids
    assert not ops.passthrough.inodes and not ops.passthrough.handles


def test_every_fd_and_backing_id_goes_back_at_release(kernel, ops, shim):
    ino = kernel.write_file(ROOT, b"f", b"x" * 4096)
    before = _open_fds()
    fhs = [_open(kernel, ino) for _ in range(3)]
    assert len({shim.lib.replies[fh][0] for fh in fhs}) == 1   # one backing per inode
    assert _open_fds() == before + 1 + 3   # the cache's own memfd, and one fd per handle
    for fh in fhs:
        kernel.call("release", fh)
    assert _open_fds() == before + 1
    assert len(shim.lib.closed) == 1 and not shim.lib.open_ids


def test_write_open_of_a_backed_inode_names_its_backing_and_keeps_direct_io(kernel, shim, cache):
    """The kernel fails (EIO) an open without FOPEN_PASSTHROUGH of an inode open in
    passthrough mode: a write open then goes through the cache under the same backing id."""
    ino = kernel.write_file(ROOT, b"f", b"old")
    reader = _open(kernel, ino)
    writer = _open(kernel, ino, os.O_WRONLY)
    assert shim.lib.replies[writer] == (shim.lib.replies[reader][0], 1)
    assert kernel.call("write", writer, 0, b"new") == 3
    assert os.pread(cache.nodes[ino].memfd, 3, 0) == b"new"   # the reader sees it, as on tmpfs
    kernel.call("release", writer)
    assert not shim.lib.closed
    kernel.call("release", reader)
    assert len(shim.lib.closed) == 1


def test_a_read_while_a_writer_is_open_is_served_by_the_cache(kernel, shim):
    ino = kernel.write_file(ROOT, b"f", b"data")
    writer = _open(kernel, ino, os.O_WRONLY)
    reader = _open(kernel, ino)
    assert writer not in shim.lib.replies and reader not in shim.lib.replies
    kernel.call("release", reader)
    kernel.call("release", writer)
    assert not shim.lib.closed


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC])
def test_opens_that_may_write_get_no_backing(kernel, cache, shim, flags):
    ino = kernel.write_file(ROOT, b"f", b"data")
    fh = _open(kernel, ino, flags)
    # a writer of an inode without a backing asks (a new file's memfd would be given for its
    # kernel to write: tests/mount/test_passthrough.py); this cache has none for it
    assert fh not in shim.lib.replies
    kernel.call("release", fh)


def test_create_of_a_backed_inode_names_its_backing(kernel, shim):
    ino = kernel.write_file(ROOT, b"f", b"data")
    reader = _open(kernel, ino)
    info, entry = kernel.create(ROOT, b"f", flags=os.O_WRONLY | os.O_CREAT)
    assert entry.st_ino == ino
    assert shim.lib.replies[info.fh] == (shim.lib.replies[reader][0], 1)
    kernel.call("release", info.fh)
    kernel.call("release", reader)


def test_no_passthrough_negotiated_changes_nothing(kernel, cache, shim):
    shim.lib.negotiated = 0
    ino = kernel.write_file(ROOT, b"f", b"data")
    fh = _open(kernel, ino)
    assert not shim.lib.replies and "backing" not in cache.calls
    assert kernel.call("read", fh, 0, 10) == b"data"
    kernel.call("release", fh)


def test_a_refused_backing_id_falls_back_without_failing_the_open(kernel, ops, shim, caplog):
    shim.lib.refuse_open = errno.EPERM
    ino = kernel.write_file(ROOT, b"f", b"data")
    before = _open_fds()
    fhs = [_open(kernel, ino) for _ in range(3)]
    assert not shim.lib.replies and _open_fds() == before + 1   # the cache's own memfd
    assert kernel.call("read", fhs[0], 0, 10) == b"data"
    warnings = [r for r in caplog.records if "passthrough" in r.getMessage()]
    assert len(warnings) == 1   # once, not per open
    assert ops.passthrough.declined == 3
    for fh in fhs:
        kernel.call("release", fh)


def test_a_failing_cache_falls_back(kernel, cache, shim):
    ino = kernel.write_file(ROOT, b"f", b"data")
    cache.fail("backing", OSError(errno.EIO, "daemon trouble"))
    fh = _open(kernel, ino)
    assert fh not in shim.lib.replies
    kernel.call("release", fh)


def test_a_cache_without_backing_falls_back(cache, shim):
    class Plain:   # a Cache with no backing method at all
        def __getattr__(self, name):
            if name == "backing":
                raise AttributeError(name)
            return getattr(cache, name)

    kernel = Kernel(Operations(Plain(), TIMEOUTS, Passthrough(shim, grace=0)))
    ino = kernel.write_file(ROOT, b"f", b"data")
    fh = _open(kernel, ino)
    assert not shim.lib.replies
    kernel.call("release", fh)


def test_directories_and_symlinks_are_left_alone(kernel, cache, shim):
    d = kernel.mkdir(ROOT, b"d").st_ino
    fh = kernel.call("opendir", d, ctx())
    kernel.call("releasedir", fh)
    assert "backing" not in cache.calls
