"""The control protocol over a unix SOCK_SEQPACKET socket: embedded mode's fast path.

Same messages as the zmq sockets (protocol.py), one per datagram. zmq moves every message
through its I/O threads: a request and its reply cost eight thread wake-ups between hostd and
bluecached, most of a FUSE request's latency on two cores. A SEQPACKET socket keeps message
boundaries and costs two. It also tells the daemon when a client goes away.

The daemon has one reader task per connection and answers straight from the serving task (a
writer task drains what a full socket made wait); hostd's callers send straight from their
own tasks, and one task reads the replies.
"""

import array
import errno
import itertools
import logging
import os
import socket

import trio

from . import protocol
from .client import Handshaking, RemoteError, _result
from .unix_listener import serve_private

log = logging.getLogger("bluecached.local")


class LocalPeer:
    """A connected client as ControlServer sees it: an identity and a reply queue."""

    _ids = itertools.count(1)

    def __init__(self, sock):
        self.sock = sock
        self.identity = b"local-%d" % next(self._ids)
        self._send, self._outbox = trio.open_memory_channel(float("inf"))
        # Replies go out at once when the socket has room (nearly always): handing each to
        # the writer task would cost a task switch per request. The writer only drains what
        # a full socket made wait, so replies never overtake each other.
        self.raw = socket.socket(fileno=os.dup(sock.fileno()))
        self.raw.setblocking(False)
        self._waiting = 0

    def send(self, payload: bytes, fd: int | None = None) -> None:
        """Sends a reply, with `fd` attached (SCM_RIGHTS) if given; the fd is closed here
        once sent (the client has its own copy then) or when it cannot be."""
        if not self._waiting:
            try:
                _send_with_fd(self.raw, payload, fd)
            except BlockingIOError:
                pass
            except OSError:
                _close(fd)
                return  # the client is gone; the reader notices and cleans up
            else:
                _close(fd)
                return
        self._waiting += 1
        self._send.send_nowait((payload, fd))

    async def write_replies(self) -> None:
        async for payload, fd in self._outbox:
            try:
                while True:
                    try:
                        _send_with_fd(self.raw, payload, fd)
                        break
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(self.raw)
            finally:
                _close(fd)
            self._waiting -= 1

    def close(self) -> None:
        self.raw.close()
        while True:   # replies never sent: their fds
            try:
                _, fd = self._outbox.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                return
            _close(fd)


def _send_with_fd(sock: socket.socket, payload: bytes, fd: int | None) -> None:
    if fd is None:
        sock.send(payload)
    else:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


# Room for a few fds per reply (one is all the protocol sends); extras the kernel closes.
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)


async def _datagrams_with_fds(raw: socket.socket, max_bytes: int):
    """As _datagrams, each message with the fds it carried (SCM_RIGHTS): (frame, fds)."""
    taken = 0
    while True:
        try:
            frame, ancillary, _, _ = raw.recvmsg(max_bytes, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(raw)
            continue
        fds = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % array.array("i").itemsize
                fds.extend(array.array("i", data[:usable]))
        if not frame:
            _close_all(fds)
            return
        yield frame, fds
        taken += 1
        if taken % 64 == 0:
            await trio.lowlevel.checkpoint()


async def _datagrams(raw: socket.socket, max_bytes: int):
    """The messages arriving on a non-blocking SEQPACKET socket until the peer closes it.
    trio's socket methods yield to the scheduler on every call, even with a message at hand;
    this waits only when there is none (and lets others run now and then in a long burst)."""
    taken = 0
    while True:
        try:
            frame = raw.recv(max_bytes)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(raw)
            continue
        if not frame:
            return
        yield frame
        taken += 1
        if taken % 64 == 0:
            await trio.lowlevel.checkpoint()


async def _serve_peer(sock, server, max_bytes: int) -> None:
    peer = LocalPeer(sock)
    server.attach_peer(peer)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer.write_replies)
            async for frame in _datagrams(peer.raw, max_bytes + 1):
                server.on_frame(peer.identity, frame)
            nursery.cancel_scope.cancel()
    except* OSError as group:   # e.g. ECONNRESET: it closed with our replies unread
        log.info("local client went away: %s", group.exceptions[0])
    finally:
        server.detach_peer(peer)
        peer.close()
        sock.close()


async def serve(path: str, server, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accepts clients at `path` (mode 0600)."""
    # A reply may carry a readdir page: allow well above the request limit.
    max_bytes = max(server.max_message_bytes, 1 << 20)
    await serve_private(path, lambda sock: _serve_peer(sock, server, max_bytes),
                        task_status=task_status)


class LocalClient(Handshaking):
    """The AsyncClient interface (call, handshake, fail_pending, run) over SEQPACKET.

    run() keeps a connection: it connects (retrying while the daemon is away), reads replies,
    and on loss fails what is pending and connects again."""

    MAX_REPLY = 16 << 20

    def __init__(self, path: str, client_name: str = ""):
        self.endpoint = path
        self.client_name = client_name
        self._sock = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}
        self.hello: dict = {}
        # Hooks for requests sent whose callers stopped waiting before the reply (timed out,
        # cancelled, or failed by fail_pending): on_abandoned(id, op, args) then,
        # on_late(id, reply) once its reply comes after all, or on_late(id, None) once the
        # connection (so the daemon) is gone.
        self.on_abandoned = None
        self.on_late = None
        self._abandoned: set[int] = set()

    def _abandon(self, rid: int, op: str, args: dict) -> None:
        if self.on_abandoned is not None:
            self._abandoned.add(rid)
            self.on_abandoned(rid, op, args)

    def _answered_late(self, rid: int, reply: dict | None = None) -> None:
        if rid in self._abandoned:
            self._abandoned.discard(rid)
            if self.on_late is not None:
                self.on_late(rid, reply)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            # The plain socket, non-blocking, is what call() and the loop below use: trio's
            # socket methods yield to the scheduler on every call, even when the kernel has
            # the message at hand, and a 1 MiB request is a few such round trips.
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            raw.setblocking(False)
            try:
                await trio.socket.from_stdlib_socket(raw).connect(self.endpoint)
            except OSError:
                raw.close()
                await trio.sleep(0.1)
                continue
            self._sock = raw
            try:
                async for frame, fds in _datagrams_with_fds(raw, self.MAX_REPLY):
                    self._on_reply(frame, fds)
            except OSError:
                pass
            finally:
                self._sock = None
                raw.close()
                self.fail_pending(errno.ECONNRESET, "connection to bluecached closed",
                                  gone=True)
                for rid in list(self._abandoned):   # their daemon closed: it serves no more
                    self._answered_late(rid)

    def _on_reply(self, frame: bytes, fds: list[int]) -> None:
        try:
            reply = protocol.decode_reply(frame, self.MAX_REPLY)
        except protocol.ProtocolError:
            _close_all(fds)
            return
        slot = self._waiting.get(reply.get("id"))
        if slot is None or slot[1] is not None:
            _close_all(fds)   # nobody waits for it (timed out, cancelled)
            if slot is not None:
                slot[1]["answered"] = True   # failed by fail_pending, answered since
            else:
                self._answered_late(reply.get("id"), reply)
            return
        if fds:
            reply["fds"] = fds
        slot[1] = reply
        slot[0].set()

    def fail_pending(self, err: int, message: str, gone: bool = False) -> None:
        """Wakes every caller still waiting with an error. `gone`: the connection closed, so
        the daemon will not serve their requests; else it may still (on_abandoned)."""
        for slot in self._waiting.values():
            if slot[1] is None:
                slot[1] = {"ok": False, "errno": err, "error": message, "failed": True,
                           "answered": gone}
                slot[0].set()

    async def call(self, op: str, timeout: float | None = None, **args):
        reply = await self._exchange(op, timeout, args)
        _close_all(reply.pop("fds", ()))   # none expected
        return _result(reply)

    async def call_with_fd(self, op: str, timeout: float | None = None,
                           **args) -> tuple[dict, int | None]:
        """A request whose reply may carry a file descriptor: (result, fd or None). The caller
        owns the fd."""
        reply = await self._exchange(op, timeout, args)
        fds = reply.pop("fds", [])
        try:
            result = _result(reply)
            if len(fds) > 1:
                raise RemoteError(errno.EPROTO, f"{op}: the reply carried {len(fds)} fds")
        except BaseException:
            _close_all(fds)
            raise
        return result, (fds[0] if fds else None)

    async def backing(self, fh: int, timeout: float | None = None) -> tuple[int, int]:
        """The object's memfd behind open handle `fh`, as (fd, size): the caller owns the fd
        and closes it when it releases the handle. RemoteError ENODATA: serve it through the
        daemon (the handle stays good)."""
        result, fd = await self.call_with_fd("backing", timeout, fh=fh)
        if fd is None:
            raise RemoteError(errno.ENODATA, "backing: the reply carried no fd")
        return fd, result["size"]

    async def _exchange(self, op: str, timeout: float | None, args: dict) -> dict:
        """Sends a request and returns its reply as it came (fds included)."""
        sock = self._sock
        if sock is None:
            raise RemoteError(errno.ECONNREFUSED, f"bluecached is not listening at "
                                                  f"{self.endpoint}")
        rid = next(self._ids)
        slot = [trio.Event(), None]
        self._waiting[rid] = slot
        sent = False
        try:
            with trio.fail_after(timeout) if timeout else _no_deadline():
                frame = protocol.encode_request(rid, op, args)
                while True:   # a SEQPACKET send is all or nothing: no interleaving callers
                    try:
                        sock.send(frame)
                        sent = True
                        break
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(sock)
                await slot[0].wait()
        except trio.TooSlowError:
            if sent:
                self._abandon(rid, op, args)
            raise RemoteError(errno.ETIMEDOUT, f"{op}: no reply within {timeout}s") from None
        except OSError as e:
            raise RemoteError(errno.ECONNRESET, f"{op}: {e}") from None
        except BaseException:   # cancelled: an fd that came meanwhile is nobody's
            if slot[1] is not None:
                _close_all(slot[1].pop("fds", ()))
            elif sent:
                self._abandon(rid, op, args)
            raise
        finally:
            del self._waiting[rid]
        if slot[1].get("failed") and not slot[1].get("answered"):
            self._abandon(rid, op, args)
        return slot[1]


def _no_deadline():
    return trio.CancelScope()
