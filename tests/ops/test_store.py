"""Store operations called directly (no sockets, no kernel), over real NVMe files."""

import errno
import os

import pytest
import trio

from bluecached.namespace import ROOT_INO, FsError
from bluecached.tiers.dram import populated_memfd
from bluecached.tiers.objects import views
from support import MiB, pattern, run


def test_round_trip_in_dram_and_after_writeback(harness):
    h = harness()
    data = pattern("a", 32 * MiB + 123)

    async def main():
        await h.put("/m/r0/ab/block.bin", data)
        assert await h.get("/m/r0/ab/block.bin") == data
        await h.settle()
        node = h.store.ns.resolve("/m/r0/ab/block.bin")
        assert node.obj.persisted and not node.obj.dirty
        h.store.tiers.drop_dram(node)          # force the next read to come from NVMe
        assert not node.obj.resident
        assert await h.get("/m/r0/ab/block.bin") == data
        assert h.store.tiers.stats.nvme.hits == 1

    run(main)
    h.check_consistency()


def test_sparse_writes_and_truncate_read_zeros(harness):
    h = harness()

    async def main():
        handle = await h.store.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_RDWR)
        await h.write(handle.fh, 3 * MiB + 5, b"xyz")
        assert h.store.ns.resolve("/f").size == 3 * MiB + 8
        got = await h.read(handle.fh, 0, 3 * MiB + 8)
        assert got == bytes(3 * MiB + 5) + b"xyz"
        await h.store.setattr(handle.node.ino, size=3 * MiB + 6)   # cut 'yz'
        await h.store.setattr(handle.node.ino, size=3 * MiB + 10)  # grow: zeros, not 'yz'
        assert await h.read(handle.fh, 3 * MiB, 10) == bytes(5) + b"x" + bytes(4)
        h.store.release(handle.fh)

    run(main)
    h.check_consistency()


def test_shrinking_a_grown_file_keeps_the_bytes_before_the_hole(harness):
    # Found by the fsx exerciser: grown past its last chunk (a hole), then cut inside the hole,
    # the file lost the bytes of its last real chunk after the new size's offset in a chunk.
    h = harness()

    async def main():
        handle = await h.store.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_RDWR)
        head = pattern("head", 1184)
        await h.write(handle.fh, 0, head)
        await h.store.setattr(handle.node.ino, size=3 * MiB)        # a hole after chunk 0
        await h.store.setattr(handle.node.ino, size=2 * MiB + 1)    # cut in the hole
        assert await h.read(handle.fh, 0, 2 * MiB + 1) == head + bytes(2 * MiB + 1 - 1184)
        await h.store.setattr(handle.node.ino, size=MiB + 7)        # cut at chunk 1
        await h.store.setattr(handle.node.ino, size=100)            # cut inside chunk 0
        await h.store.setattr(handle.node.ino, size=3000)           # grow: zeros past 100
        assert await h.read(handle.fh, 0, 3000) == head[:100] + bytes(2900)
        h.store.release(handle.fh)

    run(main)
    h.check_consistency()


def test_restart_after_clean_stop_keeps_everything(harness):
    h = harness()
    blobs = {f"/d{i % 3}/f{i}.bin": pattern(str(i), (i + 1) * 300_000) for i in range(12)}

    async def fill():
        for path, data in blobs.items():
            await h.put(path, data)
        await h.store.setattr(h.store.ns.resolve("/d1").ino, mode=0o700)

    run(fill)
    h.reopen(clean=True)
    assert h.store.ns.resolve("/d1").mode & 0o777 == 0o700

    async def check():
        for path, data in blobs.items():
            assert await h.get(path) == data

    run(check)
    h.check_consistency()


def test_restart_after_kill_shows_only_complete_objects(harness):
    h = harness()

    async def fill():
        await h.put("/done.bin", pattern("done", 5 * MiB))
        await h.settle()                      # on NVMe, in the journal
        await h.put("/dram-only.bin", pattern("dram", 2 * MiB))   # never written behind

    run(fill)
    h.store.mkdir(ROOT_INO, b"emptydir", 0o755, 0, 0)
    h.reopen(clean=False)
    ns = h.store.ns
    assert ns.resolve("/emptydir").is_dir
    with pytest.raises(FsError) as e:
        ns.resolve("/dram-only.bin")
    assert e.value.errno == errno.ENOENT
    assert run(h.get, "/done.bin") == pattern("done", 5 * MiB)


def test_an_inode_lost_at_a_kill_is_estale_to_a_kernel_that_still_holds_it(harness):
    # The kernel keeps the numbers it was given across a restart (the mount stays): one the
    # new run does not have is a stale handle (ESTALE: the kernel looks the path up again),
    # while one this run removed (a directory at its rmdir) is ENOENT, as on any disk.
    h = harness()
    run(h.put, "/dram-only.bin", pattern("dram", MiB))     # never written behind
    lost = h.store.ns.resolve("/dram-only.bin").ino
    lost_dir = h.store.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino   # journaled: kept
    h.reopen(clean=False)
    s = h.store
    assert s.ns.get(lost_dir).is_dir
    for op in (lambda: s.getattr(lost), lambda: run(s.open, lost, os.O_RDONLY),
               lambda: s.lookup(lost, b"x"), lambda: s.getxattr(lost, b"user.x"),
               lambda: run(s.create, lost, b"x", 0o644, 0, 0, os.O_WRONLY)):
        with pytest.raises(FsError) as e:
            op()
        assert e.value.errno == errno.ESTALE
    gone = s.mkdir(ROOT_INO, b"gone", 0o755, 0, 0).ino
    s.rmdir(ROOT_INO, b"gone")
    with pytest.raises(FsError) as e:
        s.mkdir(gone, b"x", 0o755, 0, 0)
    assert e.value.errno == errno.ENOENT


@pytest.mark.parametrize("size", [0, 5000])
def test_an_open_of_a_file_the_cache_removed_is_estale_while_a_kernel_still_holds_it(
        harness, size):
    # Right after an eviction the kernel may still have the name (hostd's invalidation is on
    # its way) and open the inode. ESTALE makes it look the name up again and miss, so an
    # O_CREAT open creates the file anew. Before, such an open of a non-empty file was
    # ENOENT, and of an empty one it succeeded: the writer wrote a file with no name.
    h = harness()
    run(h.put, "/f.bin", b"x" * size)
    s = h.store
    ino = s.ns.resolve("/f.bin").ino
    s.reference(ino)                                    # the kernel's lookup
    assert s.evict("/f.bin")["removed"] == 1
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
        with pytest.raises(FsError) as e:
            run(s.open, ino, flags)
        assert e.value.errno == errno.ESTALE, flags
    assert s.getattr(ino).nlink == 0
    s.unreference(ino)                                  # the kernel's forget: it goes
    assert ino not in s.ns.inodes
    h.check_consistency()


def test_a_file_its_user_unlinked_still_opens_while_a_kernel_holds_it(harness):
    # Unlike a removal by the cache: an unlinked file stays openable through the kernel's
    # inode (open of /proc/self/fd/N) while its bytes are still here.
    h = harness()
    run(h.put, "/f.bin", b"kept")
    s = h.store
    ino = s.ns.resolve("/f.bin").ino
    s.reference(ino)
    s.unlink(ROOT_INO, b"f.bin")
    handle = run(s.open, ino, os.O_RDONLY)
    s.release(handle.fh)
    s.unreference(ino)
    assert ino not in s.ns.inodes


@pytest.mark.parametrize("clean", [True, False])
def test_no_inode_number_is_handed_out_twice_across_restarts(harness, clean):
    # A number given again would name another file to a kernel still holding the old one.
    h = harness()
    before = {h.store.mkdir(ROOT_INO, b"a", 0o755, 0, 0).ino}
    run(h.put, "/f.bin", b"x")
    before.add(h.store.ns.resolve("/f.bin").ino)
    boot = h.store.boot
    h.reopen(clean=clean)
    assert h.store.boot == boot + 1
    after = {h.store.mkdir(ROOT_INO, b"b", 0o755, 0, 0).ino}
    run(h.put, "/g.bin", b"y")
    after.add(h.store.ns.resolve("/g.bin").ino)
    assert not before & after


def test_the_state_directorys_boot_counts_where_the_journal_is_behind(harness):
    h = harness(nvme=0)                   # no journal: the state directory's boot alone
    assert h.store.boot == 1
    assert h.reopen(last_boot=41).boot == 42
    h = harness()                         # a journal ahead of the state directory wins
    for _ in range(3):
        h.reopen()
    assert h.store.boot == 4
    assert h.reopen(last_boot=2).boot == 5


def test_modifying_a_persisted_file_drops_its_old_version_at_once(harness):
    h = harness()

    async def main():
        await h.put("/f", pattern("v1", 2 * MiB))
        await h.settle()
        node = h.store.ns.resolve("/f")
        handle = await h.store.open(node.ino, os.O_WRONLY)
        await h.write(handle.fh, 0, b"v2")
        h.store.release(handle.fh)

    run(main)
    h.reopen(clean=False)   # killed before write-behind: absent, never the old bytes
    with pytest.raises(FsError):
        h.store.ns.resolve("/f")


def test_checksum_mismatch_on_nvme_gives_eio_and_removes(harness):
    h = harness()
    data = pattern("c", 3 * MiB)

    async def main():
        await h.put("/x/victim.bin", data)
        await h.settle()
        node = h.store.ns.resolve("/x/victim.bin")
        h.store.tiers.drop_dram(node)
        extent = node.obj.extent
        seg = h.store.tiers.nvme
        path = seg._seg_path(extent.offset // seg.segment_size)
        with open(path, "r+b") as f:  # noqa: ASYNC230 - flip one byte in the middle chunk
            f.seek(extent.offset % seg.segment_size + MiB + 77)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        handle = await h.store.open(node.ino, os.O_RDONLY)
        with pytest.raises(FsError) as e:
            await h.read(handle.fh, 0, 3 * MiB)
        assert e.value.errno == errno.EIO
        h.store.release(handle.fh)
        return node.ino

    ino = run(main)
    assert h.store.tiers.stats.checksum_failures == 1
    with pytest.raises(FsError):
        h.store.ns.resolve("/x/victim.bin")
    assert ino not in h.store.ns.inodes
    assert ("removed", {"ino": ino, "parent": h.store.ns.resolve("/x").ino,
                        "name": b"victim.bin", "reason": "checksum mismatch"}) in h.events
    h.check_consistency()


def test_replace_swaps_content_atomically_under_a_reader(harness):
    h = harness()

    async def main():
        await h.put("/r", pattern("old", 3 * MiB))
        node = h.store.ns.resolve("/r")
        reader = await h.store.open(node.ino, os.O_RDONLY)
        writer = await h.store.open(node.ino, os.O_WRONLY)
        h.shm.view[:2 * MiB + 5] = pattern("new", 2 * MiB + 5)
        assert await h.store.replace(writer.fh, 2 * MiB + 5, h.region, 0) == 2 * MiB + 5
        assert await h.read(reader.fh, 0, 4 * MiB) == pattern("new", 2 * MiB + 5)
        crc, _ = await h.store.checksum(reader.fh)
        import crc32c
        assert crc == crc32c.crc32c(pattern("new", 2 * MiB + 5))
        with pytest.raises(FsError) as e:
            await h.store.replace(reader.fh, 1, h.region, 0)
        assert e.value.errno == errno.EBADF
        h.store.release(reader.fh)
        h.store.release(writer.fh)

    run(main)
    h.check_consistency()


@pytest.mark.parametrize("spare", [False, True])
def test_replace_fills_a_fresh_memfd_or_a_spare(harness, spare):
    """A STORE's new content in a memfd with no pages yet is written by the kernel
    (DmaEngine.to_new_file); in a spare's, whose pages are there, through its windows. Either
    way the chunks and the memfd hold the new bytes."""
    h = harness()

    async def main():
        if spare:
            h.store.tiers.dram.add_spare(populated_memfd(4))
        handle = await h.store.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_RDWR)
        data = pattern("fresh", 3 * MiB + 77)
        h.shm.view[5:5 + len(data)] = data
        assert await h.store.replace(handle.fh, len(data), h.region, 5) == len(data)
        chunks = handle.node.obj.chunks
        assert chunks.fresh is not spare
        assert b"".join(bytes(v) for v in views(chunks, 0, len(data))) == data
        assert os.pread(chunks.memfd.fd, len(data) + 1, 0) == data
        assert await h.read(handle.fh, 0, 4 * MiB) == data
        h.store.release(handle.fh)

    run(main)
    h.check_consistency()


def test_checkpoint_while_serving_loses_nothing(harness):
    h = harness()

    async def main():
        for i in range(5):
            await h.put(f"/a/{i}", pattern(f"a{i}", MiB))
        await h.settle()
        async with trio.open_nursery() as nursery:      # changes race the snapshot thread
            nursery.start_soon(h.store.checkpoint_in_background)
            for i in range(5):
                await h.put(f"/b/{i}", pattern(f"b{i}", MiB))
            h.store.rename(h.store.ns.resolve("/a").ino, b"0", ROOT_INO, b"moved")
        await h.settle()

    run(main)
    h.reopen(clean=False)

    async def check():
        assert await h.get("/moved") == pattern("a0", MiB)
        for i in range(1, 5):
            assert await h.get(f"/a/{i}") == pattern(f"a{i}", MiB)
            assert await h.get(f"/b/{i}") == pattern(f"b{i}", MiB)

    run(check)
    h.check_consistency()


@pytest.mark.parametrize("clean", [True, False], ids=["sigterm", "sigkill"])
def test_the_roots_owner_mode_and_times_survive_restarts(harness, caplog, clean):
    """An operator chowns/chmods the mount so vLLM's user can write: that must outlive a
    restart of bluecached, both clean (snapshot) and killed (journal replay), and one restart
    after another (the replayed root is snapshotted again)."""
    h = harness()
    root = h.store.root()
    run(h.store.setattr, ROOT_INO, None, 0o1777, 1234, 5678, 11 * 10**9, 22 * 10**9)
    want = (root.mode, root.uid, root.gid, root.atime_ns, root.mtime_ns, root.ctime_ns)
    assert want[:5] == (0o41777, 1234, 5678, 11 * 10**9, 22 * 10**9)
    for restart in (clean, True, False):
        caplog.clear()
        h.reopen(clean=restart)
        root = h.store.root()
        assert (root.mode, root.uid, root.gid, root.atime_ns, root.mtime_ns,
                root.ctime_ns) == want
        assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_a_name_over_255_bytes_is_enametoolong_in_every_operation(harness):
    """ENAMETOOLONG, as on any Linux file system, never ENOENT: the kernel looks a name up
    before chmod, chown, truncate, unlink, ... so the lookup must say it too."""
    h = harness()
    store = h.store
    ok = b"k" * 255
    d = store.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    run(h.put, "/d/" + ok.decode(), b"x")
    store.mkdir(d, b"s" * 255, 0o755, 0, 0)

    async def each(name: bytes) -> dict:
        calls = {
            "lookup": lambda: store.lookup(d, name),
            "find": lambda: store.find(d, name),
            "create": lambda: store.create(d, name, 0o644, 0, 0, os.O_WRONLY | os.O_CREAT),
            "mkdir": lambda: store.mkdir(d, name, 0o755, 0, 0),
            "unlink": lambda: store.unlink(d, name),
            "rmdir": lambda: store.rmdir(d, name),
            "rename from": lambda: store.rename(d, name, d, b"other"),
            "rename to": lambda: store.rename(d, ok, d, name),
        }
        got = {}
        for op, call in calls.items():
            try:
                result = call()
                if hasattr(result, "__await__"):
                    await result
                got[op] = 0
            except FsError as e:
                got[op] = e.errno
        return got

    for length in (256, 4096):
        got = run(each, b"n" * length)
        assert got == dict.fromkeys(got, errno.ENAMETOOLONG), length
    assert sorted(n for n, _, _ in store.ns.readdir(d, 0, 10)) == [b"k" * 255, b"s" * 255]
    assert store.lookup(d, ok).size == 1



@pytest.mark.parametrize("clean", [True, False], ids=["sigterm", "sigkill"])
def test_a_renamed_directory_keeps_its_links_and_takes_new_entries(harness, clean):
    h = harness()
    s = h.store
    a = s.mkdir(ROOT_INO, b"a", 0o755, 0, 0)
    s.mkdir(a.ino, b"sub", 0o755, 0, 0)
    s.rename(ROOT_INO, b"a", ROOT_INO, b"b")
    assert a.nlink == 3 and s.root().nlink == 3
    run(h.put, "/b/f", b"x")
    s.mkdir(a.ino, b"sub2", 0o755, 0, 0)
    run(h.settle)
    h.reopen(clean=clean)
    b = h.store.ns.resolve("/b")
    assert b.nlink == 4 and sorted(b.children) == [b"f", b"sub", b"sub2"]
    h.store.mkdir(b.ino, b"after", 0o755, 0, 0)


@pytest.mark.parametrize("holder_only_reads", [True, False])
def test_a_hit_does_not_wait_for_write_behind_holding_the_content_lock(harness,
                                                                        holder_only_reads):
    """Write-behind holds the object's lock for a whole CRC and NVMe write, only reading: a
    read of the resident chunks goes on beside it. A holder that changes the content (a
    write, a truncation) is still waited for."""
    h = harness()

    async def main():
        data = pattern("wb", 3 * MiB)
        await h.put("/kv", data)
        obj = h.store.ns.resolve("/kv").obj
        held, done = trio.Event(), trio.Event()

        async def holder():   # another task, as the write-behind worker is
            async with obj.content_lock():
                obj.lock_reads = holder_only_reads
                held.set()
                await done.wait()
                obj.lock_reads = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await held.wait()
            with trio.move_on_after(2) as waited:
                got = await h.get("/kv")
            done.set()
        if holder_only_reads:
            assert not waited.cancelled_caught and got == data
        else:
            assert waited.cancelled_caught
        assert await h.get("/kv") == data

    run(main)
    h.check_consistency()


def test_a_truncation_unlocks_the_chunks_it_cuts_where_the_engine_locks_pages(harness):
    """The memfd is cut at the new end only after the chunk holding it (and any past it) let
    go of an engine's page-locks: a device keeps the pages it locked, and would move the old
    ones after the file grew again. Chunks before it keep theirs."""
    h = harness()
    unlocked = []
    pool = h.store.tiers.dram
    pool.before_unmap = lambda chunk: unlocked.append(chunk)
    pool.locks_pages = lambda: True

    async def main():
        await h.put("/kv", pattern("kv", 3 * MiB))
        obj = h.store.ns.resolve("/kv").obj
        first, second = obj.chunks[0], obj.chunks[1]
        await h.store.setattr(h.store.ns.resolve("/kv").ino, size=MiB + MiB // 2)
        assert any(c is second for c in unlocked) and not any(c is first for c in unlocked)
        assert await h.get("/kv") == pattern("kv", 3 * MiB)[:MiB + MiB // 2]

    run(main)
    h.check_consistency()


@pytest.mark.parametrize("wanted", [True, False])
def test_memory_is_allocated_before_a_copy_the_engine_wants_it_for(harness, monkeypatch,
                                                                   wanted):
    """A copy from a region whose memory the engine must page-lock (CUDA) first gets the
    pages it lands in, in one call: a STORE's fresh content and a write's new chunks. Other
    regions leave the pages to the copy."""
    from bluecached.tiers.dram import Memfd
    h = harness()
    allocated = []
    real = Memfd.allocate
    monkeypatch.setattr(Memfd, "allocate",
                        lambda self, offset, length: (allocated.append((offset, length)),
                                                      real(self, offset, length)))
    monkeypatch.setattr(h.store.engine, "wants_allocated", lambda region: wanted)

    async def main():
        data = pattern("alloc", 3 * MiB)
        await h.put("/w", data)                      # writes into chunks not there yet
        assert await h.get("/w") == data
        handle = await h.store.create(h.store.root().ino, b"s", 0o644, 0, 0,
                                      os.O_WRONLY | os.O_CREAT)
        h.shm.view[:2 * MiB] = data[:2 * MiB]
        assert await h.store.replace(handle.fh, 2 * MiB, h.region, 0) == 2 * MiB
        h.store.release(handle.fh)
        assert await h.get("/s") == data[:2 * MiB]

    run(main)
    if wanted:
        assert [a for a in allocated if a == (0, MiB)] and (MiB, MiB) in allocated
    else:
        assert not allocated
    h.check_consistency()
