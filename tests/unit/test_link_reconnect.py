"""hostd's link when bluecached's end of the socket closes under it: a request sent into the
closed socket must not retry in a loop that never yields (the link's health task and the
transport's reader then never run, and every request in hostd stalls until its deadline).
A real SEQPACKET socket; a small stand-in answers for bluecached (the protocol's hello and
ping), since the point is the moment between the daemon closing and hostd noticing."""

import errno
import logging
import socket

import trio

from bluecached.wire import local_transport, protocol
from hostd.link import DaemonLink


class StandInDaemon:
    """What local_transport.serve needs of a server: answers hello and ping; `close_all()`
    shuts its peers' sockets at once, as a daemon stopping does."""

    max_message_bytes = 1 << 20

    def __init__(self):
        self.peers = {}
        self.hellos = 0

    def attach_peer(self, peer):
        self.peers[peer.identity] = peer

    def detach_peer(self, peer):
        self.peers.pop(peer.identity, None)

    def on_frame(self, identity, frame):
        request = protocol.decode_request(frame, self.max_message_bytes)
        if request.op == "hello":
            self.hellos += 1
            result = {"engine": "loopback", "incarnation": "one", "session": self.hellos,
                      "server": "stand-in", "features": []}
        elif request.op == "ping":
            result = {}
        else:
            self.peers[identity].send(protocol.encode_error(request.id, errno.ENOSYS, "no"))
            return
        self.peers[identity].send(protocol.encode_reply(request.id, result))

    def close_all(self):
        for peer in list(self.peers.values()):
            peer.raw.shutdown(socket.SHUT_RDWR)


def _closed_under_a_ping(tmp_path, stopping: bool = False) -> dict:
    """The stand-in daemon shuts its end of the connection; a ping is sent right after."""
    path = str(tmp_path / "control.seq")
    daemon = StandInDaemon()
    outcome = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(local_transport.serve, path, daemon)
            client = local_transport.LocalClient(path, client_name="test")
            await nursery.start(client.run)
            link = DaemonLink(client, None, slots=2, request_timeout=3)
            await link.connect()
            await nursery.start(link.watch)
            link.stopping = stopping
            daemon.close_all()
            # no checkpoint between: the transport's reader has not seen the close yet
            try:
                outcome["reply"] = await link.call("ping")
            except OSError as e:
                outcome["error"] = e
            outcome["hellos"] = daemon.hellos
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    return outcome


def test_a_request_sent_into_a_socket_the_daemon_closed_waits_for_the_reconnect(tmp_path):
    outcome = _closed_under_a_ping(tmp_path)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["reply"] == {}
    assert outcome["hellos"] == 2   # the link said hello again on the new connection


def test_a_daemon_lost_while_hostd_stops_is_no_warning(tmp_path, caplog):
    """`bluecachectl up` (or systemd) stops both daemons at once: hostd's last requests meet
    bluecached's closed socket, which is expected then."""
    with caplog.at_level(logging.INFO, logger="hostd.link"):
        outcome = _closed_under_a_ping(tmp_path, stopping=True)
    assert outcome.get("reply") == {}
    lost = [r for r in caplog.records if "lost bluecached" in r.getMessage()]
    assert lost and all(r.levelno == logging.INFO for r in lost)
