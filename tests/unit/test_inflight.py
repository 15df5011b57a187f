"""hostd/inflight.py: what waits for writes answered before the daemon had them."""

import trio
import trio.testing

from hostd.inflight import WritesInFlight


def test_waits_are_for_exactly_the_writes_they_must_see():
    async def main():
        w = WritesInFlight()
        a = w.add(7, 0, 100)
        b = w.add(7, 100, 200)
        c = w.add(8, 0, 100)
        d = w.add(7, 200, 300)   # disjoint from a and b
        e = w.add(7, 150, 250)   # overlaps b and d, answered after both
        log = []

        async def waiter(name, wait):
            await wait
            log.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "d's turn", w.in_order(7, d))
            nursery.start_soon(waiter, "e's turn", w.in_order(7, e))
            nursery.start_soon(waiter, "inode 7", w.settled(7))
            nursery.start_soon(waiter, "earlier", w.earlier_done())
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["d's turn"]
            w.done(7, b)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["d's turn"]   # e still overlaps d
            w.done(7, d)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["d's turn", "e's turn"]
            later = w.add(9, 0, 1)   # sent after earlier_done began: not waited for
            w.done(7, a)
            w.done(7, e)
            await trio.testing.wait_all_tasks_blocked()
            assert log[2:] == ["inode 7"] and w.pending(8) and w.pending(9)
            w.done(8, c)
            await trio.testing.wait_all_tasks_blocked()
            assert log[3:] == ["earlier"] and w.count() == 1
            w.done(9, later)
        assert not w.pending(7) and w.count() == 0
    trio.run(main)
