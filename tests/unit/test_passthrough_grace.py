"""fusefs/passthrough.py's bookkeeping without a kernel: an inode's backing id outlives its
last handle for `grace` and is reused by an open of the same memfd (the kernel refuses a new
id while it still holds the old one), and goes after that."""

import os
import time

from fusefs.passthrough import Passthrough


class FakeLib:
    BC_PT_DAEMON_IO, BC_PT_KERNEL_READS, BC_PT_KERNEL_WRITES = 0, 1, 2

    def __init__(self):
        self.next_id = 1
        self.open_ids: set[int] = set()

    def bc_passthrough_state(self):
        return 1

    def bc_backing_open(self, fd):
        self.next_id += 1
        self.open_ids.add(self.next_id)
        return self.next_id

    def bc_backing_close(self, backing_id):
        self.open_ids.remove(backing_id)
        return 0

    def bc_passthrough_set(self, fh, backing_id, mode):
        return 0

    def bc_passthrough_clear(self, fh):
        pass


class Shim:
    def __init__(self):
        self.lib = FakeLib()


def identity(fd):
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def test_a_backing_id_is_kept_for_the_grace_and_reused_for_the_same_memfd():
    shim = Shim()
    p = Passthrough(shim, grace=0.2)
    memfd, other = os.memfd_create("object"), os.memfd_create("other")
    try:
        p._register(7, 1, os.dup(memfd), identity(memfd), writing=False)
        first = p.inodes[7].backing_id
        p.released(1)
        assert 7 not in p.inodes and shim.lib.open_ids == {first}   # kept, idle
        p._register(7, 2, os.dup(memfd), identity(memfd), writing=False)
        assert p.inodes[7].backing_id == first                        # reused
        p.released(2)
        p._register(7, 3, os.dup(other), identity(other), writing=False)
        assert p.inodes[7].backing_id != first and first not in shim.lib.open_ids
        p.released(3)
        time.sleep(0.25)
        p.sweep()
        assert shim.lib.open_ids == set()                             # gone after the grace
    finally:
        os.close(memfd)
        os.close(other)


def test_grace_zero_closes_at_the_last_release():
    shim = Shim()
    p = Passthrough(shim, grace=0)
    memfd = os.memfd_create("object")
    try:
        p._register(7, 1, os.dup(memfd), identity(memfd), writing=False)
        p.released(1)
        assert shim.lib.open_ids == set()
    finally:
        os.close(memfd)


def test_no_backing_while_the_inode_has_handles_answered_without_one():
    """The kernel applies an OPEN reply when the opener runs again: a plain open answered
    first may be applied after a passthrough open answered later, and then fails with EIO
    (fs/fuse/iomode.c). So an inode's opens stay plain while it has plain handles."""
    shim = Shim()
    p = Passthrough(shim, grace=0.2)
    memfd = os.memfd_create("object")
    try:
        p._register(7, 1, None, None, writing=False)   # the cache had no memfd yet
        p._register(7, 2, os.dup(memfd), identity(memfd), writing=False)
        assert 7 not in p.inodes and shim.lib.open_ids == set()   # plain as well
        p.released(1)
        p._register(7, 3, os.dup(memfd), identity(memfd), writing=False)
        assert 7 not in p.inodes                                  # handle 2 is still plain
        p.released(2)
        p.released(3)
        p._register(7, 4, os.dup(memfd), identity(memfd), writing=False)
        assert p.inodes[7].handles == {4}                         # none left: passthrough
        p.released(4)
        assert not p.plain and not p.handles
    finally:
        os.close(memfd)
