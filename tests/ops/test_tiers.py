"""Capacity, eviction order, watermarks and the never-ENOSPC promise."""

import errno
import os

import pytest
import trio
import trio.testing

from bluecached.namespace import ROOT_INO, FsError
from support import MiB, pattern, run


def names(h):
    return {n.name.decode() for n in h.store.ns.inodes.values()
            if not n.is_dir and n.parent is not None}


def test_dram_eviction_demotes_least_recently_used_to_nvme(harness):
    h = harness(dram=16 * MiB, nvme=256 * MiB, marks=(0.9, 0.5))

    async def main():
        for i in range(4):
            await h.put(f"/f{i}", pattern(str(i), 3 * MiB))
            await h.settle()
        await h.get("/f0")                   # f0 becomes the most recently used
        await h.put("/f4", pattern("4", 6 * MiB))   # needs room: evicts f1 first, then f2
        tiers = h.store.tiers
        resident = {n.name.decode() for n in tiers.lru_dram.values()}
        assert "f1" not in resident and "f0" in resident
        assert names(h) == {f"f{i}" for i in range(5)}       # demoted, not deleted
        for i in range(4):
            assert await h.get(f"/f{i}") == pattern(str(i), 3 * MiB)

    run(main)
    assert h.store.tiers.stats.dram.evictions >= 1
    h.check_consistency()


def test_nvme_eviction_deletes_lru_and_publishes(harness):
    h = harness(dram=8 * MiB, nvme=24 * MiB, segment=8 * MiB, nvme_marks=(0.95, 0.5))

    async def main():
        for i in range(12):                   # 48 MiB through a 24 MiB NVMe tier
            await h.put(f"/b{i}", pattern(str(i), 4 * MiB))
            await h.settle()
            h.store.tiers.evict_to_watermarks()
        present = names(h)
        assert "b11" in present and "b0" not in present
        for name in present:
            assert await h.get(f"/{name}") == pattern(name[1:], 4 * MiB)
        return present

    present = run(main)
    removed = {e[1]["name"].decode() for e in h.events if e[0] == "removed"}
    assert removed == {f"b{i}" for i in range(12)} - present
    assert h.store.tiers.nvme.used_bytes <= 24 * MiB
    h.check_consistency()


def test_writes_never_fail_while_something_is_evictable(harness):
    h = harness(dram=8 * MiB, nvme=16 * MiB, segment=16 * MiB)

    async def main():
        for i in range(40):                   # 160 MiB through 8 + 16 MiB
            await h.put(f"/n{i}", pattern(str(i), 4 * MiB))
        await h.settle()
        assert await h.get("/n39") == pattern("39", 4 * MiB)

    h.serve(main)
    h.check_consistency()


def test_open_files_are_never_evicted_and_enospc_names_why(harness):
    h = harness(dram=4 * MiB, nvme=0)

    async def main():
        handles = []
        for i in range(4):
            handle = await h.store.create(ROOT_INO, f"o{i}".encode(), 0o644, 0, 0, os.O_RDWR)
            await h.write(handle.fh, 0, pattern(str(i), MiB))
            handles.append(handle)
        extra = await h.store.create(ROOT_INO, b"extra", 0o644, 0, 0, os.O_RDWR)
        with pytest.raises(FsError) as e:
            await h.write(extra.fh, 0, b"x")
        assert e.value.errno == errno.ENOSPC and "open" in str(e.value)
        for i, handle in enumerate(handles):
            assert await h.read(handle.fh, 0, MiB) == pattern(str(i), MiB)
            h.store.release(handle.fh)
        await h.write(extra.fh, 0, b"x")     # now something is evictable
        h.store.release(extra.fh)

    run(main)
    h.check_consistency()


def test_without_nvme_dram_eviction_removes(harness):
    h = harness(dram=4 * MiB, nvme=0)

    async def main():
        for i in range(6):
            await h.put(f"/z{i}", pattern(str(i), MiB))
        assert names(h) == {"z2", "z3", "z4", "z5"}

    run(main)
    assert {e[1]["name"] for e in h.events} == {b"z0", b"z1"}
    h.check_consistency()


@pytest.mark.parametrize("nvme", [256 * MiB, 0], ids=["to-nvme", "without-nvme"])
def test_empty_files_are_evicted_by_count_as_they_take_no_bytes(harness, nvme):
    # Each object in DRAM holds a memfd: 20,000 empty files once took every fd bluecached
    # could open (EMFILE, then EIO at every create). DRAM holds at most one object per chunk,
    # and write-behind does not wait for the stores to pause once DRAM is over that count.
    h = harness(dram=8 * MiB, nvme=nvme, marks=(0.5, 0.25))
    tiers = h.store.tiers
    assert tiers.dram.object_limit == 8

    async def stores():
        for i in range(40):
            await h.put(f"/e{i}", b"")
            tiers.note_foreground_write()         # a store storm, as the kernel's writes
        with trio.fail_after(30):                 # write-behind and the evictor catch up
            while len(tiers.lru_dram) > 0.5 * 8:  # at most the high watermark's count
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)

    h.serve(stores)                               # with write-behind and the evictor
    kept = names(h)
    if nvme:                              # demoted, every one still there and empty
        assert kept == {f"e{i}" for i in range(40)}
        for i in range(40):
            assert run(h.get, f"/e{i}") == b""
    else:                                 # no tier below: the oldest went, as files do
        assert kept == {f"e{i}" for i in range(40 - len(kept), 40)}
    assert tiers.stats.dram.evictions >= 40 - 4
    h.check_consistency()


def test_unlink_while_open_keeps_working_until_close(harness):
    h = harness()

    async def main():
        await h.put("/u", pattern("u", 2 * MiB))
        await h.settle()
        node = h.store.ns.resolve("/u")
        h.store.tiers.drop_dram(node)
        handle = await h.store.open(node.ino, os.O_RDONLY)
        h.store.unlink(ROOT_INO, b"u")
        with pytest.raises(FsError):
            h.store.lookup(ROOT_INO, b"u")
        assert await h.read(handle.fh, 0, 2 * MiB) == pattern("u", 2 * MiB)
        used = h.store.tiers.nvme.used_bytes
        h.store.release(handle.fh)
        assert h.store.tiers.nvme.used_bytes < used   # space back at last close
        assert node.ino not in h.store.ns.inodes

    run(main)
    h.reopen(clean=False)
    with pytest.raises(FsError):
        h.store.ns.resolve("/u")
    h.check_consistency()


def test_rename_while_open_for_writing_ends_complete_under_new_name(harness):
    """The llm-d sequence: create tmp, one big write, rename while open, then close."""
    h = harness()
    data = pattern("llmd", 32 * MiB)

    async def main():
        await h.put("/dir/block.bin", pattern("old", 32 * MiB))   # an existing version
        await h.settle()
        parent = h.store.ns.resolve("/dir").ino
        handle = await h.store.create(parent, b"block.bin_x1.tmp", 0o666, 0, 0,
                                      os.O_WRONLY | os.O_TRUNC)
        await h.write(handle.fh, 0, data)
        h.store.rename(parent, b"block.bin_x1.tmp", parent, b"block.bin")
        assert await h.get("/dir/block.bin") == data
        await h.store.flush(handle.fh)
        h.store.release(handle.fh)
        await h.settle()

    run(main)
    assert not h.store.tmp_inos
    h.reopen(clean=False)
    assert run(h.get, "/dir/block.bin") == data
    assert [n for n in h.store.ns.inodes.values() if not n.is_dir].__len__() == 1
    h.check_consistency()


def test_orphaned_tmp_files_are_collected(harness):
    h = harness(tmp_max_age=60)
    now = [10**18]
    h.store.clock = h.store.ns.clock = lambda: now[0]

    async def main():
        await h.put("/a/x.bin_1.tmp", b"orphan")
        await h.put("/a/y.bin", b"keep")
        handle = await h.store.create(h.store.ns.resolve("/a").ino, b"open.tmp", 0o644, 0, 0,
                                      os.O_WRONLY)
        now[0] += 30 * 10**9
        assert await h.store.collect_orphans() == 0       # too young
        now[0] += 61 * 10**9
        assert await h.store.collect_orphans() == 1       # the open one stays
        h.store.release(handle.fh)
        assert names(h) == {"y.bin", "open.tmp"}

    run(main)
    h.check_consistency()


def test_write_through_persists_before_flush_returns(harness):
    h = harness(write_through=True)

    async def main():
        handle = await h.store.create(ROOT_INO, b"wt", 0o644, 0, 0, os.O_WRONLY)
        await h.write(handle.fh, 0, pattern("wt", 3 * MiB))
        await h.store.flush(handle.fh)
        assert handle.node.obj.persisted
        h.store.release(handle.fh)

    run(main)
    h.reopen(clean=False)
    assert run(h.get, "/wt") == pattern("wt", 3 * MiB)


def test_a_tier_between_its_watermarks_is_left_alone(harness):
    """DRAM pressure must not make the evictor cut NVMe below its high watermark."""
    h = harness(dram=8 * MiB, nvme=16 * MiB, segment=16 * MiB, marks=(0.5, 0.25),
                nvme_marks=(0.9, 0.3))

    async def main():
        for i in range(3):                        # NVMe 12/16 MiB: above low, below high
            await h.put(f"/k{i}", pattern(str(i), 4 * MiB))
            await h.settle()
        h.store.tiers.evict_to_watermarks()       # DRAM is above its high watermark
        assert names(h) == {"k0", "k1", "k2"}
        assert h.store.tiers.dram.used_bytes <= 2 * MiB

    run(main)
    h.check_consistency()


def test_unlinked_files_held_only_by_the_kernel_do_not_wedge_writes(harness):
    """Dirty files that were unlinked while a kernel still references them can never be
    written behind: a write needing their DRAM must evict them, not wait forever."""
    h = harness(dram=8 * MiB, nvme=64 * MiB)

    async def main():
        for i in range(2):
            handle = await h.store.create(ROOT_INO, f"u{i}".encode(), 0o644, 0, 0, os.O_RDWR)
            await h.write(handle.fh, 0, pattern(str(i), 4 * MiB))
            h.store.reference(handle.node.ino)          # the kernel still holds it
            h.store.unlink(ROOT_INO, f"u{i}".encode())
            h.store.release(handle.fh)
        with trio.fail_after(5):
            await h.put("/new", pattern("new", 4 * MiB))
        assert await h.get("/new") == pattern("new", 4 * MiB)

    run(main)
    h.check_consistency()


def test_memory_is_mapped_ahead_of_writes_and_never_past_the_capacity(harness):
    from bluecached.tiers.dram import map_ahead
    h = harness(dram=16 * MiB)
    pool = h.store.tiers.dram

    def mapped() -> int:
        return pool.used_bytes // MiB + len(pool._free)

    async def settled(expected: int) -> None:   # map_ahead signals nothing: poll
        for _ in range(2000):
            if mapped() == expected:
                return
            await trio.sleep(0.005)
        raise AssertionError(f"{mapped()} chunks mapped, expected {expected}")

    async def main():
        await h.put("/early", pattern("early", 3 * MiB))   # mapped on demand: nothing ahead
        assert mapped() == 3
        async with trio.open_nursery() as nursery:
            nursery.start_soon(map_ahead, pool, 4 * MiB)
            await settled(3 + 4)
            ready = {id(c) for c in pool._free}
            await h.put("/later", pattern("later", 2 * MiB))   # takes chunks mapped ahead
            assert {id(c) for c in h.store.ns.resolve("/later").obj.chunks} <= ready
            await settled(5 + 4)                                # and the free list is topped up
            await h.put("/big", pattern("big", 8 * MiB))   # 13 in use + 4 ahead > 16
            await settled(16)                                   # = the capacity
            nursery.cancel_scope.cancel()
        for name, size in (("early", 3), ("later", 2), ("big", 8)):
            assert await h.get(f"/{name}") == pattern(name, size * MiB)
    h.serve(main)
    h.check_consistency()


def test_the_whole_tier_can_be_mapped_at_start(harness):
    from bluecached.tiers.dram import map_ahead
    h = harness(dram=16 * MiB)
    pool = h.store.tiers.dram

    async def main():
        with trio.move_on_after(5):
            await map_ahead(pool, 1 << 40)   # maps everything, then waits for takes
        assert pool.missing_chunks() == 0 and len(pool._free) == 16
        await h.put("/f", pattern("f", 5 * MiB))
        assert await h.get("/f") == pattern("f", 5 * MiB)
    h.serve(main)
    h.check_consistency()


def test_write_behind_yields_to_zero_copy_stores_as_to_writes(harness):
    # Write-behind is later by definition: while writes arrive it waits for a pause, so its
    # checksums and disk writes do not take their CPU. A zero-copy STORE (Store.replace) is
    # such a write: not counting it held the ioctl benchmark's STORE at 3,643 MiB/s against
    # 5,600-6,100 with it (2-core Intel Xeon VM).
    from bluecached.tiers.placement import WRITEBACK_QUIET_S
    h = harness()

    async def main():
        await h.put("/w", pattern("w", MiB))
        node = h.store.ns.resolve("/w")
        writer = await h.store.open(node.ino, os.O_WRONLY)
        await trio.sleep(1)                                 # a pause: write-behind goes at once
        start = trio.current_time()
        await h.store.tiers._yield_to_writers(node.obj)
        assert trio.current_time() == start
        h.shm.view[:MiB] = pattern("s", MiB)
        await h.store.replace(writer.fh, MiB, h.region, 0)
        start = trio.current_time()
        await h.store.tiers._yield_to_writers(node.obj)    # right after a STORE: it waits
        assert trio.current_time() - start >= WRITEBACK_QUIET_S
        h.store.release(writer.fh)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0),
             strict_exception_groups=True)
    h.check_consistency()


def test_a_file_past_a_segment_gets_efbig_and_one_that_got_in_stays_in_dram(harness):
    h = harness(dram=32 * MiB, nvme=32 * MiB, segment=8 * MiB)
    assert h.store.max_file_size == 8 * MiB

    async def main():
        handle = await h.store.create(ROOT_INO, b"big", 0o644, 0, 0, os.O_RDWR)
        with pytest.raises(FsError) as e:
            await h.write(handle.fh, 0, pattern("big", 9 * MiB))
        assert e.value.errno == errno.EFBIG and "segment" in str(e.value)
        with pytest.raises(FsError) as e:
            await h.store.setattr(handle.node.ino, size=8 * MiB + 1)
        assert e.value.errno == errno.EFBIG
        h.store.release(handle.fh)
        # one that came in another way (a larger segment size before, a remote object):
        # write-behind leaves it dirty in DRAM, counted, and goes on with the others
        h.store.max_file_size = 1 << 40
        await h.put("/grown", pattern("grown", 9 * MiB))
        await h.put("/small", pattern("small", 4 * MiB))
        await h.settle()
        tiers = h.store.tiers
        assert tiers.stats.writeback_failures >= 1
        assert h.store.ns.resolve("/grown").obj.dirty
        assert h.store.ns.resolve("/small").obj.persisted
        assert await h.get("/grown") == pattern("grown", 9 * MiB)

    h.serve(main)


def test_an_older_objects_write_behind_does_not_push_newer_ones_out_of_nvme(harness):
    # NVMe holds two 4 MiB objects. A file written first but closed last (its write-behind
    # waited) must not evict the two written after it: it stays in DRAM instead.
    h = harness(dram=32 * MiB, nvme=8 * MiB, segment=8 * MiB, nvme_marks=(1.0, 0.9))

    async def main():
        old = await h.store.create(ROOT_INO, b"old", 0o644, 0, 0, os.O_RDWR)
        await h.write(old.fh, 0, pattern("old", 4 * MiB))
        await trio.sleep(0.01)    # the clock moves on: "new" files are newer
        await h.put("/new1", pattern("new1", 4 * MiB))
        await h.put("/new2", pattern("new2", 4 * MiB))
        await h.settle()
        h.store.release(old.fh)   # now its write-behind runs, with NVMe full of newer data
        await h.settle()
        assert set(names(h)) == {"old", "new1", "new2"}
        assert h.store.ns.resolve("/new1").obj.persisted
        assert h.store.ns.resolve("/new2").obj.persisted
        assert h.store.ns.resolve("/old").obj.dirty
        assert await h.get("/old") == pattern("old", 4 * MiB)

    h.serve(main)
