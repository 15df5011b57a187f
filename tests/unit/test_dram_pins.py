"""Windows the DRAM pool maps ahead may be page-locked by the engine (CUDA, after_map); each
must be handed to before_unmap before it is unmapped. A registration left on an unmapped
range makes the next mapping at that address unregistrable (CUDA:
HOST_MEMORY_ALREADY_REGISTERED), which the CUDA tests once hit after spares were trimmed."""

import ctypes
import os
import threading

import trio

from bluecached.tiers.dram import (
    CHUNK_SIZE,
    DramPool,
    Memfd,
    map_ahead,
    populated_memfd,
    unmap_behind,
    zero_windows,
)


class Registrations:
    """The engine's side: which mapped windows are page-locked."""

    def __init__(self):
        self.pinned: dict[int, object] = {}

    def pin(self, chunk) -> None:
        self.pinned[ctypes.addressof(ctypes.c_char.from_buffer(chunk))] = chunk

    def unpin(self, chunk) -> None:
        if not chunk.closed:
            self.pinned.pop(ctypes.addressof(ctypes.c_char.from_buffer(chunk)), None)

    def left_on_unmapped(self) -> list[int]:
        return [address for address, chunk in self.pinned.items() if chunk.closed]


def test_every_window_mapped_ahead_is_unpinned_before_it_is_unmapped():
    regs = Registrations()
    pool = DramPool(64 * CHUNK_SIZE, before_unmap=regs.unpin, after_map=regs.pin)
    try:
        pool.add_spare(populated_memfd(8, pool.after_map))
        pool.add_spare(populated_memfd(8, pool.after_map))
        assert len(regs.pinned) == 16
        trimmed = pool.new_memfd(3 * CHUNK_SIZE)    # a spare cut to a smaller object
        assert len(trimmed.ahead) == 3 and not regs.left_on_unmapped()
        trimmed.drop_ahead()                        # complete without taking them
        assert not regs.left_on_unmapped()
        trimmed.close()
        reused = pool.new_memfd(None)               # a spare taken whole, then freed
        chunks = [pool.take(reused, i) for i in range(2)]
        pool.give_content(reused, chunks)
        zero_windows(reused, pool.after_map)        # map_ahead's part
        pool.add_spare(reused)
        assert not regs.left_on_unmapped()
    finally:
        pool.close()
    assert not regs.left_on_unmapped()
    assert not regs.pinned, "page-locks left after the pool closed"


class CountedRegistrations(Registrations):
    def __init__(self):
        super().__init__()
        self.pins = self.unpins = 0

    def pin(self, chunk) -> None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
        if address not in self.pinned:
            self.pins += 1
        super().pin(chunk)

    def unpin(self, chunk) -> None:
        if not chunk.closed:
            self.unpins += ctypes.addressof(ctypes.c_char.from_buffer(chunk)) in self.pinned
        super().unpin(chunk)


def test_a_freed_content_reused_as_a_spare_keeps_its_page_locks():
    """Reuse is what makes a spare cheap for a GPU's copy: unlocking 32 windows and locking
    them again cost ~3.6 ms per 32 MiB block on an H200 host (gpu-notes.md)."""
    regs = CountedRegistrations()
    pool = DramPool(64 * CHUNK_SIZE, before_unmap=regs.unpin, after_map=regs.pin)
    try:
        pool.ahead_chunks = 64
        pool.add_spare(populated_memfd(8, pool.after_map))
        memfd = pool.new_memfd(8 * CHUNK_SIZE)
        chunks = [pool.take(memfd, i) for i in range(8)]
        assert (regs.pins, regs.unpins) == (8, 0)
        pool.give_content(memfd, chunks)
        zero_windows(memfd, pool.after_map)
        pool.add_spare(memfd)
        assert (regs.pins, regs.unpins) == (8, 0), "locked again, or unlocked, on reuse"
        assert len(regs.pinned) == 8 and not regs.left_on_unmapped()
    finally:
        pool.close()
    assert not regs.pinned and regs.unpins == 8


def test_spares_mapped_before_the_engine_wanted_them_prepared_are_prepared_once():
    """A first CUDA region: spares mapped at start (before any) are page-locked by map_ahead
    too, not by the first copies into them on the request's path."""
    regs = CountedRegistrations()
    wanted = []

    def after_map(chunk):   # the loopback engine locks only once a CUDA region exists
        if wanted:
            regs.pin(chunk)

    pool = DramPool(64 * CHUNK_SIZE, before_unmap=regs.unpin, after_map=after_map)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(map_ahead, pool, 16 * CHUNK_SIZE)
            await wait_until(lambda: len(pool._free) == 16)
            assert regs.pins == 0
            wanted.append(True)
            pool.prepare_spares()
            await wait_until(lambda: regs.pins == 16)
            pool.prepare_spares()          # once only
            await trio.sleep(0.2)
            assert regs.pins == 16
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        pool.close()
    assert not regs.pinned and not regs.left_on_unmapped()


async def wait_until(condition, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while not condition():  # noqa: ASYNC110 (polls state a worker thread changes)
            await trio.sleep(0.01)


def test_allocate_gives_the_pages_and_keeps_the_size():
    memfd = Memfd(4 * CHUNK_SIZE)
    try:
        assert os.fstat(memfd.fd).st_blocks == 0
        memfd.allocate(CHUNK_SIZE, 2 * CHUNK_SIZE)
        st = os.fstat(memfd.fd)
        assert st.st_size == 4 * CHUNK_SIZE and st.st_blocks * 512 >= 2 * CHUNK_SIZE
        memfd.allocate(3 * CHUNK_SIZE, 8 * CHUNK_SIZE)   # clipped at the size
        assert os.fstat(memfd.fd).st_size == 4 * CHUNK_SIZE
    finally:
        memfd.close()


def test_a_freed_content_is_unlocked_and_unmapped_off_the_event_loop():
    """unmap_behind: a FORGET's unlocking and munmap of a whole object run in a worker
    thread; every window still goes through before_unmap first, and what is queued when the
    task ends is closed then."""
    regs = CountedRegistrations()
    threads = set()

    def unpin(chunk):
        threads.add(threading.get_ident())
        regs.unpin(chunk)

    pool = DramPool(64 * CHUNK_SIZE, before_unmap=unpin, after_map=regs.pin)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unmap_behind, pool)
            await wait_until(lambda: pool._unmapper is not None)
            memfd = pool.new_memfd(4 * CHUNK_SIZE)          # no spares: a fresh memfd
            chunks = [pool.take(memfd, i) for i in range(4)]
            for c in chunks:
                regs.pin(c)
            pool.give_content(memfd, chunks)              # no prefault budget: closed
            assert pool.used_bytes == 0 and memfd.fd >= 0   # counted free, closed later
            await wait_until(lambda: memfd.fd == -1)
            assert regs.unpins == 4 and threading.get_ident() not in threads
            queued = pool.new_memfd(2 * CHUNK_SIZE)
            chunks = [pool.take(queued, i) for i in range(2)]
            pool.give_content(queued, chunks)
            nursery.cancel_scope.cancel()
        assert queued.fd == -1

    try:
        trio.run(main)
    finally:
        pool.close()
    assert not regs.pinned and not regs.left_on_unmapped()


def test_clearing_keeps_the_pages_where_an_engine_may_have_locked_them():
    """A punched hole frees the pages; a device that locked them keeps reading and writing
    those. With keep_pages the same pages hold the zeros. (1.5 MiB: no 2 MiB page fits
    within the size, so the pages are 4 KiB ones, which a punch frees, whatever policy up to
    within_size the daemons left.)"""
    for keep in (False, True):
        memfd = Memfd(CHUNK_SIZE + CHUNK_SIZE // 2)
        window = memfd.window(1)
        try:
            window[:CHUNK_SIZE // 2] = b"\x5a" * (CHUNK_SIZE // 2)
            blocks = os.fstat(memfd.fd).st_blocks
            memfd.clear_from(CHUNK_SIZE + CHUNK_SIZE // 4, keep_pages=keep)
            after = os.fstat(memfd.fd).st_blocks   # (before a read faults new pages in)
            assert (after == blocks) if keep else (after < blocks)
            assert window[:CHUNK_SIZE // 4] == b"\x5a" * (CHUNK_SIZE // 4)
            assert window[CHUNK_SIZE // 4:CHUNK_SIZE // 2] == bytes(CHUNK_SIZE // 4)
        finally:
            window.close()
            memfd.close()
