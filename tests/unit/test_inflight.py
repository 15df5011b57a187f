"""hostd/inflight.py: what waits for writes answered before the daemon had them."""

import trio
import trio.testing

from hostd.inflight import WritesInFlight


def test_waits_are_for_exactly_the_writes_they_must_see():
    async def main():
        w = WritesInFlight()
        a = w.add(7)
        b = w.add(7)
        c = w.add(8)
        log = []

        async def waiter(name, wait):
            await wait
            log.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "inode 7", w.settled(7))
            nursery.start_soon(waiter, "earlier", w.earlier_done())
            await trio.testing.wait_all_tasks_blocked()
            assert log == []
            w.done(7, b)
            later = w.add(9)   # sent after earlier_done began: not waited for
            await trio.testing.wait_all_tasks_blocked()
            assert log == []         # a is still out
            w.done(7, a)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["inode 7"] and w.pending(8) and w.pending(9)
            w.done(8, c)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["inode 7", "earlier"] and w.count() == 1
            w.done(9, later)
        assert not w.pending(7) and w.count() == 0
    trio.run(main)
