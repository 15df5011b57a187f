"""Clones started at a lookup for the open that follows (bluecached/tiers/clone_ahead.py): the
open takes the one of its object's extent and version, and every clone nobody takes is closed."""

import os
import threading

import trio
import trio.testing

from bluecached.tiers.clone_ahead import ClonesAhead

EXTENT, OTHER = object(), object()


CLONE_NAME = "bc-test-clone"


def open_clones() -> int:
    """This process's fds of clones the Cloner made (counted by name: other tests' threads
    may open and close fds of their own meanwhile)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += CLONE_NAME in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # closed meanwhile (the listing's own fd, say)
            pass
    return count


class Cloner:
    """Stands in for SegmentStore.clone: an fd per clone, and the calls it had."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.calls = []
        self.gate = gate
        self.fail = fail

    def __call__(self, extent, size):
        self.calls.append((extent, size))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise OSError(95, "no reflinks here")
        return os.memfd_create(CLONE_NAME)


def run(body, cloner, real_clock=False, **kwargs):
    pins = []

    def pinned():
        pins.append(1)
        return lambda: pins.pop()

    async def main():
        ahead = ClonesAhead(cloner, **kwargs)
        async with trio.open_nursery() as nursery:
            result = await body(ahead, lambda ino, extent, version, size=4096: ahead.start(
                nursery, ino, extent, version, size, pinned))
            nursery.cancel_scope.cancel()
        return result

    before = open_clones()
    clock = None if real_clock else trio.testing.MockClock(autojump_threshold=0)
    result = trio.run(main, clock=clock, strict_exception_groups=True)
    assert not pins, "an object left pinned"
    assert open_clones() == before, "a clone left open"
    return result


def test_the_open_takes_the_clone_of_its_extent_and_version():
    async def body(ahead, start):
        start(7, EXTENT, 3)
        start(7, EXTENT, 3)   # the kernel's second lookup: the same clone
        fd = await ahead.take(7, EXTENT, 3, 4096)
        os.close(fd)
        return fd, ahead.taken, await ahead.take(7, EXTENT, 3, 4096)

    cloner = Cloner()
    fd, taken, again = run(body, cloner)
    assert fd is not None and taken == 1 and again is None   # one open, one clone
    assert cloner.calls == [(EXTENT, 4096)]


def test_a_clone_of_what_the_object_no_longer_is_is_not_given():
    async def body(ahead, start):
        start(7, EXTENT, 3)
        changed = [await ahead.take(7, EXTENT, 4, 4096)]   # written since the lookup
        start(7, EXTENT, 3)
        changed.append(await ahead.take(7, OTHER, 3, 4096))   # moved (written behind again)
        start(7, EXTENT, 3)
        changed.append(await ahead.take(7, EXTENT, 3, 8192))   # grew
        return changed, ahead.taken

    assert run(body, Cloner()) == ([None, None, None], 0)


def test_a_clone_nobody_opens_is_closed_after_the_hold():
    async def body(ahead, start):
        start(7, EXTENT, 3)
        await trio.sleep(0.1)
        held = len(ahead)
        await trio.sleep(0.5)
        return held, len(ahead)

    # the real clock: the clone is made in a thread, which a mock clock would not wait for
    assert run(body, Cloner(), real_clock=True, hold=0.3) == (1, 0)


def test_clones_held_when_the_daemon_stops_are_closed():
    async def body(ahead, start):
        start(7, EXTENT, 3)
        await trio.sleep(0.1)
        return len(ahead)

    assert run(body, Cloner(), real_clock=True, hold=60) == 1


def test_no_more_than_the_limit_at_once():
    async def body(ahead, start):
        for ino in range(5):
            start(ino, EXTENT, 1)
        return len(ahead), ahead.made

    assert run(body, Cloner(), limit=3) == (3, 3)


def test_the_open_waits_for_a_clone_in_flight():
    gate = threading.Event()

    async def body(ahead, start):
        start(7, EXTENT, 3)
        async with trio.open_nursery() as nursery:
            got = []

            async def open_it():
                got.append(await ahead.take(7, EXTENT, 3, 4096))

            nursery.start_soon(open_it)
            await trio.testing.wait_all_tasks_blocked()
            waited = not got
            gate.set()
        os.close(got[0])
        return waited, ahead.taken

    assert run(body, Cloner(gate)) == (True, 1)


def test_a_clone_replaced_while_in_flight_is_closed_when_made():
    gate = threading.Event()

    async def body(ahead, start):
        start(7, EXTENT, 3)
        await trio.testing.wait_all_tasks_blocked()
        start(7, EXTENT, 4)   # written meanwhile: the first clone is nobody's
        gate.set()
        fd = await ahead.take(7, EXTENT, 4, 4096)
        os.close(fd)
        await trio.sleep(2)
        return ahead.made, ahead.taken

    assert run(body, Cloner(gate)) == (2, 1)


def test_a_failed_clone_leaves_the_open_to_clone_itself():
    async def body(ahead, start):
        start(7, EXTENT, 3)
        return await ahead.take(7, EXTENT, 3, 4096)

    assert run(body, Cloner(fail=True)) is None
