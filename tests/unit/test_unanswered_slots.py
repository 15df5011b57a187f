"""A request hostd stopped waiting for (bluecached stopped or too slow: daemon.request_timeout)
may still be served when the daemon runs again, and then it moves bytes into or out of the
staging slot it names. That slot must not carry anything else until then: reused, a late read
would overwrite a write staged in it since, which would then be stored as that file's bytes.
And a request waits for a free slot no longer than for the daemon."""

import errno
import logging

import pytest
import trio
from silent_daemon import linked

from bluecached.wire.client import RemoteError


async def held_read(nursery, path: str):
    """A link to a SilentDaemon with two slots, and a read the daemon held past
    request_timeout: (daemon, link), the read's slot still taken."""
    daemon, link = await linked(nursery, path, slots=2, request_timeout=0.3, read_ahead=0)
    fh = link._add_file(5, 0, daemon_fh=9, size=1 << 20)
    with pytest.raises(RemoteError) as e:
        await link.read(fh, 0, 4096)            # the daemon holds it: timed out
    assert e.value.errno == errno.ETIMEDOUT
    assert link.staging.free() == 1             # its slot stays out of use
    return daemon, link


async def all_slots_free(link) -> None:
    with trio.fail_after(5):
        while link.staging.free() < 2:  # noqa: ASYNC110 (a count, no event)
            await trio.sleep(0.01)


def test_a_slot_named_by_an_unanswered_read_is_not_reused_until_the_reply(tmp_path):
    path = str(tmp_path / "control.seq")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await held_read(nursery, path)
            assert [op for _, op in daemon.held] == ["read"]
            other = await link.staging.take()           # the other slot...
            with pytest.raises(RemoteError) as e:       # ... and a request waits for a
                await link.staging.take()               # slot only as long as for the daemon
            assert e.value.errno == errno.ETIMEDOUT
            link.staging.give(other)
            await daemon.answer_held()                  # the late reply: the slot is free
            await all_slots_free(link)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)


def test_slots_held_for_a_daemon_that_went_away_come_back(tmp_path):
    path = str(tmp_path / "control.seq")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await held_read(nursery, path)
            daemon.hang_up()                            # it died: nothing can touch the slot
            await all_slots_free(link)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)


@pytest.mark.parametrize("op", ["open", "create"])
def test_a_handle_opened_after_its_caller_gave_up_is_released(tmp_path, op):
    """The kernel got EIO for an open (or create) the daemon then did after all: no kernel
    will ever release the handle it made, so hostd does (it would hold the file open at the
    daemon for good: never evicted, its memory never freed)."""
    path = str(tmp_path / "control.seq")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await linked(nursery, path, slots=2, request_timeout=0.3,
                                        read_ahead=0)
            nursery.start_soon(link.forward_releases)
            nursery.start_soon(link.watch)
            with pytest.raises(RemoteError) as e:
                if op == "open":
                    await link.open(5, 0)
                else:
                    await link.create(1, b"new", 0o644, 0, 0, 0o1)
            assert e.value.errno in (errno.ETIMEDOUT, errno.EIO)
            daemon.silent = False
            await daemon.answer_held({"fh": 42, "attr": {}})
            with trio.fail_after(5):
                while ("release", {"fh": 42}) not in daemon.seen:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)


def test_a_file_whose_staged_write_failed_is_dropped_first_thing_when_the_daemon_is_back(
        tmp_path):
    """With write_ack: staged the writer was answered before the daemon failed to answer: the
    file must go (no reader may get it without those bytes). The daemon cannot be told while
    it is stopped; it is told before any other request once it answers again, so that a
    rename waiting meanwhile cannot make the file visible."""
    path = str(tmp_path / "control.seq")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await linked(nursery, path, slots=4, request_timeout=0.3,
                                        ack_staged=True, read_ahead=0)
            await nursery.start(link.send_writes)
            fh = link._add_file(7, 0o1, daemon_fh=9, size=0)   # open for writing
            assert await link.write(fh, 0, b"x" * 4096) == 4096   # answered once staged
            with pytest.raises(RemoteError):
                await link.flush(fh)            # the daemon never took it: close says so
            assert link._undropped == {7}
            assert [op for op, _ in daemon.seen] == ["hello", "write_batch"]
            daemon.silent = False
            await daemon.answer_held()
            nursery.start_soon(link.watch)      # reconnects: hello, then the discard
            with trio.fail_after(10):
                while link._undropped:  # noqa: ASYNC110 (a set, no event)
                    await trio.sleep(0.01)
            after = [(op, args) for op, args in daemon.seen[2:] if op != "hello"]
            assert after[0] == ("discard", {"ino": 7})
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)


def test_large_read_buffers_sit_after_the_slots_and_are_held_as_slots():
    """Reads larger than a slot (mount.max_pages) go whole into large buffers after the
    slots: a buffer named by an unanswered request is held as a slot is."""
    from hostd.link import SLOT_SIZE, SLOT_STRIDE, Staging

    async def main():
        staging = Staging(4, large=2, large_size=4 * SLOT_SIZE)
        try:
            # the buffers start on a 2 MiB boundary, the region ends on one (huge pages)
            assert len(staging.region.view) == (6 << 20) + 2 * 4 * SLOT_SIZE   # 4 slots: 6 MiB
            buffers = [await staging.take_large(), await staging.take_large()]
            assert sorted(buffers) == [4, 5] and staging.take_large_nowait() == -1
            for b in buffers:   # contiguous, inside the region, after every slot
                assert staging.offset(b) >= 4 * SLOT_STRIDE
                assert staging.offset(b) % (2 << 20) == 0
                assert staging.slot_at(staging.offset(b)) == b
                assert len(staging.view(b, 4 * SLOT_SIZE)) == 4 * SLOT_SIZE
            assert staging.slot_at(staging.offset(3)) == 3
            staging.hold([buffers[0]])
            staging.give(buffers[0])
            staging.give(buffers[1])
            assert staging.free_large() == 1          # the held one waits for its reply
            staging.release([buffers[0]])
            assert staging.free_large() == 2 and staging.free() == 4
        finally:
            staging.region.close()

    trio.run(main, strict_exception_groups=True)


def test_no_large_buffers_for_reads_of_a_slot():
    from hostd.link import SLOT_SIZE, Staging
    staging = Staging(2, large=16, large_size=SLOT_SIZE)   # mount.max_pages 256: none
    try:
        assert staging.large == staging.large_size == staging.free_large() == 0
        assert staging.take_large_nowait() == -1
    finally:
        staging.region.close()


def test_a_release_cut_off_by_the_daemon_going_away_is_not_a_warning(tmp_path, caplog):
    """`bluecachectl up` stopped: both daemons get SIGTERM at once, and a release hostd sent
    just then is cut off. Nothing is lost (bluecached releases the handles of a session
    that ends), so hostd must not warn that it was not delivered."""
    path = str(tmp_path / "control.seq")
    caplog.set_level(logging.DEBUG, logger="hostd.link")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon, link = await linked(nursery, path, slots=2, request_timeout=5,
                                        read_ahead=0)
            nursery.start_soon(link.forward_releases)
            fh = link._add_file(5, 0o1, daemon_fh=9, size=0)
            await link.release(fh)
            with trio.fail_after(5):
                while [op for _, op in daemon.held] != ["release"]:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            daemon.hang_up()
            with trio.fail_after(5):
                while "went with its session" not in caplog.text:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    assert "not delivered" not in caplog.text
