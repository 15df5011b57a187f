"""Sessions at the control server, without sockets: what a session holds is let go when it
ends, also what a request still being served at that moment gives it afterwards."""

import errno
import os

import trio
import trio.testing

from bluecached.server import ControlServer
from bluecached.wire import protocol
from support import MiB, pattern

# Replies to "local-" identities with no peer attached are dropped (the client went away), so
# the server runs here without a socket.
OLD, NEW = b"local-old", b"local-new"


def _request(rid: int, op: str, **args) -> protocol.Request:
    return protocol.Request(rid, op, args)


def _hello(rid: int, **args) -> protocol.Request:
    return _request(rid, "hello", versions=list(protocol.SUPPORTED_VERSIONS), **args)


def test_an_open_served_while_its_session_is_replaced_leaves_no_handle(harness):
    # Seen in CI: bluecached stopped (SIGSTOP) with hostd's open queued; hostd gave up,
    # reconnected naming its old session in `replaces`, and once bluecached ran again the
    # reconnect ended the old session while the open was still being served. The handle the
    # open made afterwards belonged to nobody: open_handles stayed 1 for good.
    h = harness(dram=32 * MiB)
    server = ControlServer(h.store, h.regions, status=dict, stats=dict, verifier=None)
    held = trio.Event()
    release_open = trio.Event()
    real_open = server.op_open

    async def open_held_at_start(session, **args):
        # holds the open where it would wait on the disk or a lock: the point where the
        # reconnect overtakes it
        held.set()
        await release_open.wait()
        return await real_open(session, **args)

    server.op_open = open_held_at_start

    async def main():
        await h.put("/f", pattern("f", 2 * MiB))
        ino = h.store.ns.resolve("/f").ino
        await server._serve(OLD, _hello(1))
        old = server.sessions[OLD]
        await server._serve(OLD, _request(2, "lookup", parent=1, name=b"f"))
        assert h.store.kernel_refs.get(ino)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._serve, OLD, _request(3, "open", ino=ino,
                                                            flags=os.O_RDONLY))
            await held.wait()
            await server._serve(NEW, _hello(4, replaces=old.id))
            assert old.ended and OLD not in server.sessions
            release_open.set()
        assert h.store.handles == {}
        assert not h.store.kernel_refs.get(ino)
        # the new session opens and releases as usual
        server.op_open = real_open
        await server._serve(NEW, _request(5, "open", ino=ino, flags=os.O_RDONLY))
        assert len(h.store.handles) == 1
        (fh,) = h.store.handles
        await server._serve(NEW, _request(6, "release", fh=fh))
        assert h.store.handles == {}

    h.serve(main)
    h.check_consistency()


def test_a_handle_is_used_only_by_the_session_that_opened_it(harness):
    # A client's stale handle number (from a daemon since restarted, which numbers handles
    # from 1 again) must fail at the daemon, not close, read or write another client's file.
    h = harness(dram=32 * MiB)
    server = ControlServer(h.store, h.regions, status=dict, stats=dict, verifier=None)
    replies = {}

    def record(identity, payload, fd=None):
        reply = protocol.decode_reply(payload)
        replies[reply["id"]] = reply

    server._reply = record

    async def main():
        await h.put("/f", pattern("f", 2 * MiB))
        ino = h.store.ns.resolve("/f").ino
        await server._serve(OLD, _hello(1))
        await server._serve(NEW, _hello(2))
        await server._serve(OLD, _request(3, "open", ino=ino, flags=os.O_RDWR))
        (fh,) = h.store.handles
        await server._serve(NEW, _request(4, "release", fh=fh))
        await server._serve(NEW, _request(5, "flush", fh=fh))
        await server._serve(NEW, _request(6, "write_batch", region=0, fhs=[fh], offsets=[0],
                                          lengths=[1], region_offsets=[0]))
        for rid in (4, 5):
            assert not replies[rid]["ok"] and replies[rid]["errno"] == errno.EBADF, replies[rid]
        assert replies[6]["ok"] and replies[6]["result"]["failed"][0][1] == errno.EBADF
        assert list(h.store.handles) == [fh]
        await server._serve(OLD, _request(7, "release", fh=fh))
        assert replies[7]["ok"] and h.store.handles == {}

    h.serve(main)
    h.check_consistency()
