"""The remote tier's parts, without S3: its RemoteLink (one request without an answer marks
the tier down, the next answer brings it back and wakes the upload workers once; an answered
error leaves it up), and the StoreView that is all it knows of the store."""

from types import SimpleNamespace

import pytest
import trio

from bluecached.namespace import FsError
from bluecached.tiers.remote import RemoteCounters, RemotePolicy, RemoteTier
from bluecached.tiers.remote_link import RemoteLink
from bluecached.tiers.s3 import S3Error
from support import run


class FakeS3:
    def __init__(self):
        self.deleted = []
        self.answering = True

    def delete(self, key):
        if not self.answering:
            raise S3Error("connection refused", unreachable=True)
        self.deleted.append(key)

    def probe(self):
        if not self.answering:
            raise S3Error("connection refused", unreachable=True)


def test_no_answer_marks_it_down_until_an_answer():
    s3, counters, recovered = FakeS3(), RemoteCounters(), []
    link = RemoteLink(s3, counters, on_recovered=lambda: recovered.append(True))

    async def main():
        link.failed(S3Error("403 Forbidden", status=403))
        assert link.reachable and counters.errors == 1 and link.last_error == "403 Forbidden"
        s3.answering = False
        await link.delete_quietly("a")
        assert not link.reachable and counters.errors == 2
        assert not await link.probe() and counters.errors == 2   # a probe's failure: no count
        woke = []

        async def waiter():
            await link.wait_up()
            woke.append(link.reachable)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.01)
            assert not woke
            s3.answering = True
            assert await link.probe()
        assert woke == [True] and recovered == [True]
        await link.delete_quietly(None)   # a file without a key: nothing to delete
        await link.delete_quietly("b")
        assert s3.deleted == ["b"] and recovered == [True]

    run(main)


class PathsOnly:
    """A StoreView that knows paths and nothing else: what the tier asks shows in `asked`."""

    def __init__(self):
        self.asked = []

    def directory_path(self, ino):
        self.asked.append(("directory_path", ino))
        return b"/d"

    def path_of(self, node):
        self.asked.append(("path_of", node.ino))
        return b"/d/f"


def test_the_tier_asks_the_store_only_through_its_view():
    view = PathsOnly()
    tier = RemoteTier(FakeS3(), RemotePolicy(prefix="p/"), tiers=None, store=view)
    assert tier.key_of(SimpleNamespace(ino=7, parent=2, extra=None)) == "p/d/f"
    tier.link.failed(S3Error("timed out", unreachable=True))

    async def lookup():
        with pytest.raises(FsError):
            await tier.lookup(2, b"g")

    run(lookup)
    assert view.asked == [("path_of", 7), ("directory_path", 2)]
    assert tier.stats.skipped_down == 1 and not tier.reachable
