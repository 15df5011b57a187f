"""Reads of an object only on NVMe, by tiers.nvme.hit_path (tiers/promotion.py): direct (read
from the disk straight into the reply, checked chunk by chunk, no DRAM taken; the next open
promotes), stream (promoted, each chunk served once it is in and checked) and promote (the
whole object first). Byte-exact in every mode; a chunk that fails its CRC32C is never served
and removes the object."""

import errno
import os
import threading

import pytest
import trio

from bluecached.namespace import FsError
from bluecached.tiers import promotion
from support import MiB, pattern, run

SIZE = 5 * MiB + 4097   # a partial last chunk: its read ends at the object's end


def serving(h, mode: str, fn):
    """fn() with the daemon's promotions service running in `mode`."""
    async def main():
        async with trio.open_nursery() as nursery:
            h.store.tiers.promotions.configure(mode)
            await nursery.start(h.store.tiers.promotions.run)
            try:
                return await fn()
            finally:
                nursery.cancel_scope.cancel()
    return run(main)


async def on_nvme_only(h, path: str, data: bytes):
    await h.put(path, data)
    await h.settle()
    node = h.store.ns.resolve(path)
    h.store.tiers.drop_dram(node)
    assert node.obj.chunks is None and node.obj.extent is not None
    return node


async def read_all(h, node, offset: int = 0, step: int = MiB) -> bytes:
    handle = await h.store.open(node.ino, os.O_RDONLY)
    try:
        return await h.read(handle.fh, offset, node.size - offset, step=step)
    finally:
        h.store.release(handle.fh)


def corrupt(h, node, at: int) -> None:
    seg = h.store.tiers.nvme
    extent = node.obj.extent
    with open(seg._seg_path(extent.offset // seg.segment_size), "r+b") as f:
        f.seek(extent.offset % seg.segment_size + at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_direct_serves_a_first_hit_from_disk_and_the_next_open_promotes(harness):
    h = harness()
    data = pattern("direct", SIZE)
    stats = h.store.tiers.stats

    async def main():
        node = await on_nvme_only(h, "/m/a.bin", data)
        misses = stats.dram.misses
        assert await read_all(h, node) == data
        assert node.obj.chunks is None                 # no DRAM taken
        assert stats.dram.misses == misses and stats.nvme.hits == 1
        assert stats.nvme.bytes_out == SIZE
        assert await read_all(h, node) == data         # hit again: promoted, streaming
        if node.obj.arrival is not None:               # the promotion ends
            await node.obj.arrival.wait_complete()
        assert node.obj.chunks is not None and stats.dram.misses == misses + 1
        assert stats.nvme.bytes_out == SIZE            # the second read came from DRAM
        assert await read_all(h, node) == data

    serving(h, "direct", main)
    h.check_consistency()


def test_direct_leaves_reads_not_of_whole_chunks_to_a_promotion(harness):
    h = harness()
    data = pattern("odd", SIZE)

    async def main():
        node = await on_nvme_only(h, "/odd.bin", data)
        assert await read_all(h, node, offset=100, step=300_000) == data[100:]
        assert h.store.tiers.stats.nvme.bytes_out == 0

    serving(h, "direct", main)
    h.check_consistency()


@pytest.mark.parametrize("mode", ["direct", "stream", "promote"])
def test_a_chunk_that_fails_its_checksum_is_never_served(harness, mode):
    h = harness()
    data = pattern(mode, SIZE)

    async def main():
        node = await on_nvme_only(h, "/x/victim.bin", data)
        corrupt(h, node, 3 * MiB + 77)
        handle = await h.store.open(node.ino, os.O_RDONLY)
        got = b""
        with pytest.raises(FsError) as e:
            for offset in range(0, SIZE, MiB):
                got += await h.read(handle.fh, offset, min(MiB, SIZE - offset))
        h.store.release(handle.fh)
        assert e.value.errno == errno.EIO
        assert got == data[:len(got)] and len(got) <= 3 * MiB   # nothing past the bad chunk
        return node.ino

    ino = serving(h, mode, main)
    assert h.store.tiers.stats.checksum_failures == 1
    with pytest.raises(FsError):
        h.store.ns.resolve("/x/victim.bin")
    assert ino not in h.store.ns.inodes
    assert any(event == "removed" and f["reason"] == "checksum mismatch"
               for event, f in h.events)
    h.check_consistency()


def test_stream_serves_readers_while_the_object_comes_in(harness):
    h = harness()
    data = pattern("stream", SIZE)

    async def main():
        node = await on_nvme_only(h, "/s.bin", data)
        handles = [await h.store.open(node.ino, os.O_RDONLY) for _ in range(2)]
        got = [b"", b""]

        async def reader(k):
            got[k] = await h.read(handles[k].fh, 0, SIZE, at=k * MiB)

        async with trio.open_nursery() as nursery:
            for k in range(2):
                nursery.start_soon(reader, k)
        for handle in handles:
            h.store.release(handle.fh)
        assert got == [data, data]
        assert node.obj.chunks is not None and h.store.tiers.stats.dram.misses == 1

    serving(h, "stream", main)
    h.check_consistency()


def test_direct_reads_of_one_object_reach_the_disk_one_at_a_time(harness):
    """read_lanes.py: a reader's pieces asked for together are read one after the other (the
    disk answers a batch only when all of it is in); another object's reads go beside them."""
    h = harness()
    seg = h.store.tiers.nvme
    real_read = seg.read
    lock = threading.Lock()
    running: dict[int, int] = {}   # object's extent start -> its disk reads running now
    most = {}
    started = {}                    # extent start -> set when one of its reads began

    async def main():
        a = await on_nvme_only(h, "/lane/a.bin", pattern("a", SIZE))
        b = await on_nvme_only(h, "/lane/b.bin", pattern("b", SIZE))
        objects = {a.obj.extent.offset: b.obj.extent.offset,   # each one's the other
                   b.obj.extent.offset: a.obj.extent.offset}
        spans = {n.obj.extent.offset: n.obj.extent.length for n in (a, b)}
        for key in objects:
            started[key] = threading.Event()

        def read(extent, chunks, length):
            key = next(k for k in objects if k <= extent.offset < k + spans[k])
            with lock:
                running[key] = running.get(key, 0) + 1
                most[key] = max(most.get(key, 0), running[key])
            started[key].set()
            try:
                # the other object's reads run beside this one: a lane per object, not one
                # for the disk (a single lane would wait here until the timeout and fail)
                assert started[objects[key]].wait(10), "the other object's reads never ran"
                real_read(extent, chunks, length)
            finally:
                with lock:
                    running[key] -= 1

        seg.read = read
        handles = {n.ino: await h.store.open(n.ino, os.O_RDONLY) for n in (a, b)}
        got = {}

        async def piece(node, k, at):
            n = await h.store.read(handles[node.ino].fh, k * MiB, MiB, h.region, at)
            got[node.ino, k] = bytes(h.shm.view[at:at + n])

        async with trio.open_nursery() as nursery:
            for j, node in enumerate((a, b)):
                for k in (3, 1, 2, 0):   # out of order, as read-ahead's tasks may ask
                    nursery.start_soon(piece, node, k, (j * 4 + k) * MiB)
        for node, name in ((a, "a"), (b, "b")):
            h.store.release(handles[node.ino].fh)
            data = pattern(name, SIZE)
            assert [got[node.ino, k] for k in range(4)] == \
                [data[k * MiB:(k + 1) * MiB] for k in range(4)]
        assert most == {key: 1 for key in objects}
        assert h.store.tiers.read_lanes.busy() == 0

    try:
        serving(h, "direct", main)
    finally:
        seg.read = real_read
    h.check_consistency()


@pytest.mark.parametrize("mode", ["direct", "stream", "promote"])
@pytest.mark.parametrize("offset,step", [(0, MiB), (100, 300_000)], ids=["chunks", "unaligned"])
def test_a_read_with_no_room_in_dram_is_served_from_nvme_past_it(harness, caplog, mode,
                                                                  offset, step):
    """DRAM full of a file still being written (nothing to evict): a read of an object only
    on NVMe is served from the disk, checked, without waiting for write-behind and without
    taking DRAM (straight into the reply for whole chunks, through a buffer otherwise), and
    the writer's bytes stay. Once the writer is done, the object is read into DRAM as usual.
    (Before: EIO "no DRAM for it"; found by a capacity probe.)"""
    h = harness(dram=8 * MiB, nvme=64 * MiB)
    data = pattern("nodram", SIZE)
    written = pattern("writing", 8 * MiB)

    async def main():
        node = await on_nvme_only(h, "/cold.bin", data)
        writer = await h.store.create(h.store.root().ino, b"writing.bin", 0o644, 0, 0,
                                      os.O_WRONLY | os.O_CREAT)
        await h.write(writer.fh, 0, written)   # every chunk of DRAM

        async def no_waiting():
            raise AssertionError("a read waited for write-behind to make room")
        tiers = h.store.tiers
        tiers._wait_for_writeback, waiting = no_waiting, tiers._wait_for_writeback
        assert await read_all(h, node, offset=offset, step=step) == data[offset:]
        tiers._wait_for_writeback = waiting
        stats = h.store.tiers.stats.nvme
        assert node.obj.chunks is None and stats.bytes_out == SIZE - offset
        assert stats.past_dram == (0 if direct_anyway else -(-(SIZE - offset) // step))
        h.store.release(writer.fh)
        writing = h.store.ns.resolve("/writing.bin")
        assert await read_all(h, writing) == written
        await h.settle()   # on NVMe: evictable now
        assert await read_all(h, node, offset=offset, step=step) == data[offset:]
        assert node.obj.chunks is not None

    # whole chunks with hit_path direct take no DRAM whether it has room or not
    direct_anyway = mode == "direct" and offset == 0
    serving(h, mode, main)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == (not direct_anyway)   # once in PAST_DRAM_LOG_S
    assert all("no room in DRAM" in m for m in warned)
    h.check_consistency()


@pytest.mark.parametrize("offset,step", [(0, MiB), (100, 300_000)], ids=["chunks", "unaligned"])
def test_a_read_past_dram_never_serves_a_rotten_chunk(harness, offset, step):
    """As every NVMe read: a chunk whose CRC32C does not match is not served (EIO), and the
    object is removed."""
    h = harness(dram=8 * MiB, nvme=64 * MiB)

    async def main():
        node = await on_nvme_only(h, "/rot.bin", pattern("rot", SIZE))
        corrupt(h, node, 2 * MiB + 5)
        writer = await h.store.create(h.store.root().ino, b"writing.bin", 0o644, 0, 0,
                                      os.O_WRONLY | os.O_CREAT)
        await h.write(writer.fh, 0, pattern("writing", 8 * MiB))   # every chunk of DRAM
        with pytest.raises(FsError) as e:
            await read_all(h, node, offset=offset, step=step)
        assert e.value.errno == errno.EIO and "checksum" in str(e.value)
        assert h.store.tiers.stats.checksum_failures == 1
        with pytest.raises(FsError):
            h.store.ns.resolve("/rot.bin")
        h.store.release(writer.fh)

    serving(h, "stream", main)
    h.check_consistency()


def test_a_bug_in_one_promotion_fails_its_readers_not_the_daemon(harness, monkeypatch, caplog):
    """A promotion is a task of the service's nursery: an unexpected exception in it would end
    the daemon, with every object only DRAM holds. It fails that object's readers (EIO),
    is logged with its traceback, and the next promotion runs."""
    h = harness()
    data = pattern("bug", SIZE)
    real = promotion.read_verify_and_mark

    def broken(*args):
        raise RuntimeError("a bug")

    async def main():
        node = await on_nvme_only(h, "/bug.bin", data)
        monkeypatch.setattr(promotion, "read_verify_and_mark", broken)
        with pytest.raises(FsError) as e:
            await read_all(h, node)
        assert e.value.errno == errno.EIO
        monkeypatch.setattr(promotion, "read_verify_and_mark", real)
        assert await read_all(h, node) == data

    serving(h, "stream", main)
    assert any("promotion of inode" in r.getMessage() and r.exc_info for r in caplog.records)
    h.check_consistency()
