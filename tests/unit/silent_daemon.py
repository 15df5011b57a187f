"""A bluecached stand-in over a real socket for DaemonLink's unit tests: it answers hello and
holds every other request until told, recording what it was asked."""

import socket

import trio

from bluecached.wire import protocol
from bluecached.wire.local_transport import LocalClient
from hostd.link import DaemonLink


class SilentDaemon:
    """Answers hello at once; holds every other request until `answer_held`."""

    def __init__(self, path: str):
        self.path = path
        self.held: list[tuple[int, str]] = []
        self.seen: list[tuple[str, dict]] = []
        self.silent = True
        self.conn = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.setblocking(False)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        with trio.socket.from_stdlib_socket(self.listener) as listener:
            conn, _ = await listener.accept()
        self.conn = conn
        with conn:
            while True:
                frame = await conn.recv(1 << 20)
                if not frame:
                    return
                request = protocol.decode_request(frame, 1 << 20)
                self.seen.append((request.op, request.args))
                if request.op != "hello" and not self.silent:
                    await conn.send(protocol.encode_reply(request.id, {"length": 0,
                                                                       "failed": []}))
                elif request.op == "hello":
                    await conn.send(protocol.encode_reply(request.id, {
                        "engine": "loopback", "incarnation": "one", "session": 1,
                        "server": "silent"}))
                else:
                    self.held.append((request.id, request.op))

    def hang_up(self):
        """As a daemon that exits: its end of the connection closes."""
        self.conn.shutdown(socket.SHUT_RDWR)

    async def answer_held(self, result=None):
        for rid, _op in self.held:
            await self.conn.send(protocol.encode_reply(
                rid, result if result is not None else {"length": 0, "failed": []}))
        self.held.clear()


async def linked(nursery, path: str, **link_settings) -> tuple[SilentDaemon, DaemonLink]:
    """A SilentDaemon at `path` and a DaemonLink (`link_settings`: its keyword arguments)
    connected to it, both running in `nursery`."""
    daemon = SilentDaemon(path)
    client = LocalClient(path)
    link = DaemonLink(client, None, **link_settings)
    await nursery.start(daemon.serve)
    await nursery.start(client.run)
    await link.connect(timeout=5)
    return daemon, link
