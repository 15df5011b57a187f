"""Python client of the bluecached protocol: async (hostd, tests) and blocking (bluecachectl).

Requests carry ids, so an async client keeps many outstanding on one socket; its socket is
owned by one task (zmqpump) and callers wait on their own reply.
"""

import array
import contextlib
import errno
import itertools
import socket

import msgpack
import trio
import zmq

from ..shm import SharedRegion
from . import protocol
from .zmqpump import SocketPump


class RemoteError(OSError):
    """The daemon answered with an error: errno and its message."""


def _result(reply: dict):
    if reply.get("ok"):
        return reply.get("result")
    err = reply.get("errno")
    raise RemoteError(err if isinstance(err, int) else errno.EIO, str(reply.get("error")))


def _socket(ctx: zmq.Context, kind: int, curve: dict | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:  # {"server_public", "public", "secret"} as z85 bytes
        sock.curve_serverkey = curve["server_public"]
        sock.curve_publickey = curve["public"]
        sock.curve_secretkey = curve["secret"]
    return sock


class Handshaking:
    """The version handshake, for clients with `call` and `client_name`."""

    async def handshake(self, timeout: float | None = 10, replaces: int | None = None) -> dict:
        args = {"versions": list(protocol.SUPPORTED_VERSIONS), "client": self.client_name}
        if replaces is not None:
            args["replaces"] = replaces
        self.hello = await self.call("hello", timeout=timeout, **args)
        return self.hello


class AsyncClient(Handshaking):
    def __init__(self, endpoint: str, curve: dict | None = None, client_name: str = "",
                 ctx: zmq.Context | None = None):
        self.endpoint = endpoint
        self.client_name = client_name
        self._sock = _socket(ctx or zmq.Context.instance(), zmq.DEALER, curve)
        self._sock.connect(endpoint)
        self._pump = SocketPump(self._sock)
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}  # id -> [event, reply]
        self.hello: dict = {}
        # As LocalClient's: requests sent whose callers stopped waiting before the reply.
        self.on_abandoned = None
        self.on_late = None
        self._abandoned: set[int] = set()

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            reply = protocol.decode_reply(frames[-1])
        except protocol.ProtocolError:
            return  # not ours to crash on: the caller times out
        slot = self._waiting.get(reply.get("id"))
        if slot is None:
            if reply.get("id") in self._abandoned:
                self._abandoned.discard(reply.get("id"))
                if self.on_late is not None:
                    self.on_late(reply.get("id"), reply)
        elif slot[1] is not None:
            slot[1]["answered"] = True   # failed by fail_pending, answered since
        else:
            slot[1] = reply
            slot[0].set()

    def _abandon(self, rid: int, op: str, args: dict) -> None:
        if self.on_abandoned is not None:
            self._abandoned.add(rid)
            self.on_abandoned(rid, op, args)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await self._pump.run(self._on_reply)
        finally:
            self._sock.close()

    async def call(self, op: str, timeout: float | None = None, **args):
        rid = next(self._ids)
        slot = [trio.Event(), None]
        self._waiting[rid] = slot
        try:
            self._pump.send([protocol.encode_request(rid, op, args)])
            with trio.fail_after(timeout) if timeout else contextlib.nullcontext():
                await slot[0].wait()
        except trio.TooSlowError:
            self._abandon(rid, op, args)
            raise RemoteError(errno.ETIMEDOUT, f"{op}: no reply within {timeout}s") from None
        except BaseException:   # cancelled
            if slot[1] is None:
                self._abandon(rid, op, args)
            raise
        finally:
            del self._waiting[rid]
        if slot[1].get("failed") and not slot[1].get("answered"):
            self._abandon(rid, op, args)
        return _result(slot[1])

    async def backing(self, fh: int, timeout: float | None = None) -> tuple[int, int]:
        """Never over zmq (it carries no file descriptors; in DPU mode the memory is on
        another machine): ENODATA, serve it through the daemon, without asking it."""
        raise RemoteError(errno.ENODATA, "no backing: file descriptors pass only over the "
                                         "local unix socket")

    async def call_with_fd(self, op: str, timeout: float | None = None,
                           **args) -> tuple[dict, None]:
        """As LocalClient's: zmq carries no file descriptors, so never one."""
        return await self.call(op, timeout=timeout, **args), None

    def fail_pending(self, err: int, message: str) -> None:
        """Wakes every caller still waiting with an error (the daemon went away: their
        replies will never come)."""
        for slot in self._waiting.values():
            if slot[1] is None:
                slot[1] = {"ok": False, "errno": err, "error": message, "failed": True}
                slot[0].set()


@contextlib.asynccontextmanager
async def connect(endpoint: str, curve: dict | None = None, client_name: str = "",
                  timeout: float | None = 10):
    """An AsyncClient that has completed the version handshake."""
    client = AsyncClient(endpoint, curve, client_name)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await client.handshake(timeout)
        yield client
        nursery.cancel_scope.cancel()


class SyncClient:
    """Blocking client, one request at a time (bluecachectl)."""

    def __init__(self, endpoint: str, curve: dict | None = None, timeout: float = 10,
                 client_name: str = "bluecachectl"):
        self._sock = _socket(zmq.Context.instance(), zmq.DEALER, curve)
        self._sock.connect(endpoint)
        self.endpoint = endpoint
        self.timeout = timeout
        self._ids = itertools.count(1)
        try:
            self.hello = self.call("hello", versions=list(protocol.SUPPORTED_VERSIONS),
                                   client=client_name)
        except BaseException:
            self._sock.close()
            raise

    def call(self, op: str, **args):
        rid = next(self._ids)
        self._sock.send(protocol.encode_request(rid, op, args))
        while True:
            if not self._sock.poll(int(self.timeout * 1000)):
                raise RemoteError(errno.ETIMEDOUT,
                                  f"bluecached at {self.endpoint} did not answer {op} within "
                                  f"{self.timeout:g}s: is it running?")
            reply = protocol.decode_reply(self._sock.recv_multipart()[-1])
            if reply.get("id") == rid:
                return _result(reply)

    def close(self) -> None:
        self._sock.close()


# -- region registration (loopback engine) ---------------------------------------------------


class RegionChannel:
    """Connection to the daemon's region socket; regions registered through it live until it
    is closed (or this process dies)."""

    def __init__(self, path: str, timeout: float | None = None):
        """`timeout`: how long connecting or any answer may take (socket.timeout, an OSError,
        after that: the daemon is stopped or hung); None waits as long as it takes."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except BaseException:
            self._sock.close()
            raise

    def _ask(self, msg: dict, fds=()) -> dict:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self._sock.sendmsg([msgpack.packb(msg, use_bin_type=True)], anc)
        reply = msgpack.unpackb(self._sock.recv(4096), raw=False)
        if not reply.get("ok"):
            raise RemoteError(reply.get("errno", errno.EIO), reply.get("error", "failed"))
        return reply

    def register(self, region: SharedRegion) -> int:
        return self.register_fd(region.fd, region.length)

    def register_fd(self, fd: int, length: int, kind: str = "memfd") -> int:
        """Registers memory behind an fd (the daemon maps [0, length))."""
        return self._ask({"op": "register", "length": length, "kind": kind}, [fd])["region"]

    def unregister(self, region_id: int) -> None:
        self._ask({"op": "unregister", "region": region_id})

    def close(self) -> None:
        self._sock.close()
