"""An open answered by its client from a memfd it kept (hostd/kept_backings.py), at the store:
`keep` counts it as a backing only while that memfd is the object's, and the store says when
a lent memfd leaves its object ("left-dram"), whatever the reason."""

import errno
import os

import pytest
import trio

from bluecached.namespace import FsError
from support import MiB, pattern


async def _lend(h, path: str) -> tuple[int, list[int]]:
    """A reader's open with its backing, released: what hostd keeps. (fd, identity)"""
    handle = await h.store.open(h.store.ns.resolve(path).ino, os.O_RDONLY)
    fd, _ = h.store.backing(handle.fh)
    h.store.release(handle.fh)
    st = os.fstat(fd)
    return fd, [st.st_dev, st.st_ino]


def _left(h) -> list[int]:
    return [f["ino"] for event, f in h.events if event == "left-dram"]


def test_a_kept_open_counts_as_a_backing_while_the_memfd_is_the_objects(harness):
    h = harness(dram=32 * MiB)

    async def main():
        await h.put("/f", pattern("f", 3 * MiB))
        node = h.store.ns.resolve("/f")
        fd, identity = await _lend(h, "/f")
        handle = await h.store.open(node.ino, os.O_RDONLY)
        assert h.store.keep(handle.fh, identity)
        assert handle.backed and node.obj.backed == 1   # eviction skips it while open
        h.store.release(handle.fh)
        assert node.obj.backed == 0
        # another memfd's identity, or one never lent: not this object's
        other = await h.store.open(node.ino, os.O_RDONLY)
        assert not h.store.keep(other.fh, [identity[0], identity[1] + 1])
        with pytest.raises(FsError) as e:
            h.store.keep(other.fh, identity[:1])
        assert e.value.errno == errno.EINVAL
        h.store.release(other.fh)
        # a writer's open is never answered from a kept memfd, nor a reader's while written
        writer = await h.store.open(node.ino, os.O_WRONLY)
        assert not h.store.keep(writer.fh, identity)
        reader = await h.store.open(node.ino, os.O_RDONLY)
        assert not h.store.keep(reader.fh, identity)
        h.store.release(reader.fh)
        h.store.release(writer.fh)
        assert os.pread(fd, 4 * MiB, 0) == pattern("f", 3 * MiB)
        os.close(fd)
        assert _left(h) == []
    h.serve(main)
    h.check_consistency()


def test_a_lent_memfd_leaving_dram_is_published_and_no_longer_kept(harness):
    h = harness(dram=8 * MiB)

    async def main():
        await h.put("/f", pattern("f", 3 * MiB))
        await h.put("/never-lent", pattern("n", 3 * MiB))
        await h.settle()
        node = h.store.ns.resolve("/f")
        fd, identity = await _lend(h, "/f")
        for i in range(4):   # through an 8 MiB tier: /f goes to NVMe only
            await h.put(f"/other{i}", pattern(f"o{i}", 3 * MiB))
            await h.settle()
            await trio.sleep(0.05)
        assert node.obj.chunks is None and node.obj.extent is not None
        assert _left(h) == [node.ino]        # the one never lent is not announced
        # the reader kept the old bytes; a kept open now is refused, also once back in DRAM
        assert os.pread(fd, 4 * MiB, 0) == pattern("f", 3 * MiB)
        assert await h.get("/f") == pattern("f", 3 * MiB)
        handle = await h.store.open(node.ino, os.O_RDONLY)
        assert not h.store.keep(handle.fh, identity)
        assert not handle.backed
        h.store.release(handle.fh)
        os.close(fd)
    h.serve(main)
    h.check_consistency()


def test_a_lent_memfd_of_a_removed_file_is_published(harness):
    h = harness(dram=32 * MiB)

    async def main():
        await h.put("/gone", pattern("g", MiB))
        ino = h.store.ns.resolve("/gone").ino
        fd, _ = await _lend(h, "/gone")
        assert h.store.evict("/gone") == {"removed": 1, "skipped_open": 0}
        assert _left(h) == [ino]
        os.close(fd)
    h.serve(main)
    h.check_consistency()
