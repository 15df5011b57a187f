"""hostd/readahead.py without a kernel or a daemon: what is read ahead, when it is served and
when it is thrown away, and that every slot it takes comes back."""

import errno

import pytest
import trio
import trio.testing
from silent_daemon import linked

from bluecached.wire.client import RemoteError
from hostd.link import SLOT_SIZE
from hostd.readahead import LARGE_DEPTH, ReadAhead

SLOT = 1 << 20
FH, INO, GEN = 3, 40, 1
BIG = 1 << 40   # a file size read-ahead never reaches


class FakeStaging:
    """The link's Staging as ReadAhead uses it: take_nowait, give, free, slots."""

    def __init__(self, slots: int = 16, large: int = 4):
        self.slots = slots
        self._free = list(range(slots))
        self._large = list(range(slots, slots + large))
        self.large = large

    def take_nowait(self) -> int:
        return self._free.pop() if self._free else -1

    def take_large_nowait(self) -> int:
        return self._large.pop() if self._large else -1

    def free_large(self) -> int:
        return len(self._large)

    def give(self, slot: int) -> None:
        assert slot not in self._free + self._large, f"slot {slot} given back twice"
        (self._large if slot >= self.slots else self._free).append(slot)

    def free(self) -> int:
        return len(self._free)


class FakeDaemon:
    """Answers read-ahead fetches when the test says so (or fails them)."""

    def __init__(self, file_size: int = 1 << 40):
        self.asked: list[int] = []
        self.release = trio.Event()
        self.error: RemoteError | None = None
        self.file_size = file_size

    async def fetch(self, fh, offset, slot, length=None) -> int:
        self.asked.append(offset)
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return max(0, min(length or SLOT, self.file_size - offset))


def run(test, depth: int = 1, file_size: int = 1 << 40, large: int = 4):
    """Runs `test(ahead, staging, daemon)` in a nursery that hosts the fetches; afterwards
    every slot must be back."""
    staging, daemon = FakeStaging(large=large), FakeDaemon(file_size)

    async def main():
        ahead = ReadAhead(staging, daemon.fetch, SLOT, depth)
        async with trio.open_nursery() as nursery:
            ahead.nursery = nursery
            await test(ahead, staging, daemon)
            daemon.release.set()
        for fh in list(ahead._pending):      # what a release would do with the rest
            ahead.closed(fh, INO, writable=False)
    trio.run(main)
    assert staging.free() == staging.slots and staging.free_large() == staging.large


def test_the_next_read_at_the_offset_read_ahead_is_served_from_its_slot():
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == [SLOT] and staging.free() == staging.slots - 1
        daemon.release.set()
        slot, length = await ahead.take(FH, SLOT, SLOT, GEN)
        assert length == SLOT and ahead.served == 1 and ahead.wasted == 0
        staging.give(slot)        # the reader's part
    run(test)


@pytest.mark.parametrize("what", ["other offset", "writer opened", "truncated", "restart",
                                  "fetch failed"])
def test_a_read_ahead_that_may_be_stale_or_wrong_is_not_served(what):
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        offset, generation = SLOT, GEN
        if what == "other offset":
            offset = 5 * SLOT
        elif what == "writer opened":
            ahead.opened(INO, writable=True)
            ahead.closed(99, INO, writable=True)     # and closed again: still not served
        elif what == "truncated":
            ahead.changing(INO)
        elif what == "restart":
            generation = GEN + 1
        else:
            daemon.error = RemoteError(errno.EIO, "bad block")
        daemon.release.set()
        assert await ahead.take(FH, offset, SLOT, generation) is None
        assert ahead.served == 0 and ahead.wasted == 1
    run(test)


def test_a_file_with_a_writer_open_is_not_read_ahead():
    async def test(ahead, staging, daemon):
        ahead.opened(INO, writable=True)
        ahead.opened(INO, writable=False)
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == []
        ahead.closed(7, INO, writable=True)
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == [SLOT]
    run(test)


def test_closing_a_handle_mid_fetch_gives_its_slot_back_when_the_fetch_ends():
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        ahead.closed(FH, INO, writable=False)
        assert staging.free() == staging.slots - 1   # the daemon may still be writing it
        daemon.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert staging.free() == staging.slots and ahead.wasted == 1
    run(test)


def test_read_ahead_takes_no_slot_when_fewer_than_half_are_free():
    async def test(ahead, staging, daemon):
        held = [staging.take_nowait() for _ in range(staging.slots // 2 + 1)]
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == []
        for slot in held:
            staging.give(slot)
    run(test)


def test_one_window_per_handle_kept_depth_slots_ahead():
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, BIG, GEN)
        ahead.start(FH, INO, SLOT, BIG, GEN)          # already full: nothing more
        ahead.start(FH + 1, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(daemon.asked) == [SLOT, SLOT, 2 * SLOT, 2 * SLOT, 3 * SLOT, 3 * SLOT]
        daemon.release.set()
        slot, _ = await ahead.take(FH, SLOT, SLOT, GEN)
        staging.give(slot)
        ahead.start(FH, INO, 2 * SLOT, BIG, GEN)      # tops the window up
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked[-1] == 4 * SLOT
        assert await ahead.take(FH, 3 * SLOT, SLOT, GEN) is None    # skipped 2: all thrown away
        assert ahead.wasted == 3 and ahead.served == 1
    run(test, depth=3)


def test_nothing_is_read_ahead_past_the_end_seen():
    async def test(ahead, staging, daemon):
        daemon.release.set()
        ahead.start(FH, INO, SLOT, BIG, GEN)          # asks for 1 and 2; 2 is past the end
        await trio.testing.wait_all_tasks_blocked()
        for offset, length in ((SLOT, SLOT // 2),):
            slot, got = await ahead.take(FH, offset, SLOT, GEN)
            assert got == length
            staging.give(slot)
        ahead.start(FH, INO, 2 * SLOT, BIG, GEN)      # the last fetch came back short: stop
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(daemon.asked) == [SLOT, 2 * SLOT]
    run(test, depth=2, file_size=SLOT + SLOT // 2)


def test_a_change_to_another_file_leaves_a_read_ahead_alone():
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, BIG, GEN)
        ahead.changing(INO + 1)
        ahead.opened(INO + 1, writable=True)
        daemon.release.set()
        slot, _ = await ahead.take(FH, SLOT, SLOT, GEN)
        staging.give(slot)
    run(test)


def test_nothing_is_read_ahead_past_the_size_at_open():
    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, SLOT, 2 * SLOT + 1, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(daemon.asked) == [SLOT, 2 * SLOT]
    run(test, depth=4)


def test_no_read_ahead_while_more_than_two_files_are_open_for_reading():
    async def test(ahead, staging, daemon):
        for ino in (INO, INO + 1, INO + 2):
            ahead.opened(ino, writable=False)
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == []
        ahead.closed(FH + 2, INO + 2, writable=False)
        ahead.start(FH, INO, SLOT, BIG, GEN)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == [SLOT]
    run(test)


def test_reads_larger_than_a_slot_are_read_ahead_by_their_size_into_large_buffers():
    piece = 4 * SLOT

    async def test(ahead, staging, daemon):
        ahead.start(FH, INO, piece, BIG, GEN, piece)
        await trio.testing.wait_all_tasks_blocked()
        # at most LARGE_DEPTH large buffers ahead, whatever mount.read_ahead says
        assert sorted(daemon.asked) == [k * piece for k in range(1, LARGE_DEPTH + 1)]
        assert (staging.free() == staging.slots
                and staging.free_large() == staging.large - LARGE_DEPTH)
        daemon.release.set()
        slot, length = await ahead.take(FH, piece, piece, GEN)
        assert slot >= staging.slots and length == piece
        staging.give(slot)
        # the last read of a file, sized by the kernel to its end: served from the piece
        slot, length = await ahead.take(FH, 2 * piece, piece - 8192, GEN)
        assert slot >= staging.slots and length == piece
        staging.give(slot)
        # a larger read at the next offset: more than was read ahead, all thrown away
        assert await ahead.take(FH, 3 * piece, 2 * piece, GEN) is None
        assert ahead.wasted == LARGE_DEPTH - 2 and ahead.served == 2
    run(test, depth=2 * LARGE_DEPTH, large=16)


def test_large_read_ahead_leaves_one_large_buffer_to_readers():
    async def test(ahead, staging, daemon):
        taken = [staging.take_large_nowait() for _ in range(staging.large - 2)]
        ahead.start(FH, INO, 4 * SLOT, BIG, GEN, 4 * SLOT)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.asked == [4 * SLOT] and staging.free_large() == 1
        for slot in taken:
            staging.give(slot)
    run(test, depth=4)


def test_read_ahead_starts_beside_a_sequential_reader_s_first_read(tmp_path):
    """The first full read of a file asks for the pieces after it at once, not once it is
    answered: on an NVMe hit the disk then reads ahead while the first piece is on its way."""
    path = str(tmp_path / "control.seq")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await linked(nursery, path, slots=16, request_timeout=5,
                                        read_ahead=3)
            await nursery.start(link.send_writes)
            fh = link._add_file(5, 0, daemon_fh=9, size=8 * SLOT_SIZE)
            nursery.start_soon(link.read, fh, 0, SLOT_SIZE)
            with trio.fail_after(5):
                while len(daemon.held) < 4:   # noqa: ASYNC110 (a count, no event)
                    await trio.sleep(0.01)
            reads = [args["offset"] for op, args in daemon.seen if op == "read"]
            assert sorted(reads) == [0, SLOT_SIZE, 2 * SLOT_SIZE, 3 * SLOT_SIZE]
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)

