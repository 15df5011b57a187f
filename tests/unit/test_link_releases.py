"""A reader's release waits a moment (hostd/link.py RELEASE_DELAY_S): the lookups and opens
its reader sends next reach bluecached first, and any other call waits until it was sent."""

import os

import pytest
import trio
import trio.testing

from hostd.link import RELEASE_DELAY_S, DaemonLink


class RecordingClient:
    def __init__(self):
        self.calls = []   # (op, trio time)

    async def handshake(self, timeout=None, replaces=None):
        return {"engine": "loopback", "incarnation": "x", "session": 1, "server": "test"}

    async def call(self, op, timeout=None, **args):
        self.calls.append((op, trio.current_time()))
        await trio.sleep(0.0001)   # a round trip
        return {}


def run(scenario) -> list[tuple[str, float]]:
    """Calls bluecached saw, in order, with times relative to the first release queued."""
    client = RecordingClient()
    link = DaemonLink(client, None, slots=2, request_timeout=5)

    async def main():
        await link.connect()
        async with trio.open_nursery() as nursery:
            await nursery.start(link.forward_releases)
            await scenario(link)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0),
             strict_exception_groups=True)
    return client.calls


async def close(link, flags: int, daemon_fh: int = 9) -> float:
    fh = link._add_file(5, flags, daemon_fh=daemon_fh, size=0)
    await link.release(fh)
    return trio.current_time()


def test_a_readers_next_lookup_and_open_overtake_its_release():
    async def scenario(link):
        scenario.closed = await close(link, os.O_RDONLY)
        await link.call("lookup", parent=1, name=b"next")
        await link.call("open", ino=6, flags=os.O_RDONLY | os.O_DIRECT)

    calls = run(scenario)
    assert [op for op, _ in calls] == ["lookup", "open", "release"]
    assert calls[-1][1] == pytest.approx(scenario.closed + RELEASE_DELAY_S)


@pytest.mark.parametrize("op,args", [
    ("unlink", {"parent": 1, "name": b"gone"}),
    ("statfs", {}),
    ("open", {"ino": 5, "flags": os.O_WRONLY}),
    ("open", {"ino": 5, "flags": os.O_RDONLY | os.O_TRUNC}),
])
def test_a_call_a_release_may_change_sends_the_release_first(op, args):
    async def scenario(link):
        scenario.closed = await close(link, os.O_RDONLY)
        await close(link, os.O_RDONLY, daemon_fh=10)
        await link.call(op, **args)

    calls = run(scenario)
    assert [op for op, _ in calls] == ["release", "release", op]
    assert calls[0][1] < scenario.closed + RELEASE_DELAY_S   # not waiting out the delay


def test_a_writers_release_is_sent_at_once():
    async def scenario(link):
        await close(link, os.O_WRONLY)
        await trio.testing.wait_all_tasks_blocked()   # the kernel's next request comes later
        await link.call("lookup", parent=1, name=b"next")

    assert [op for op, _ in run(scenario)] == ["release", "lookup"]
