"""One trio task owns one zmq socket.

pyzmq has no trio integration, and a zmq socket's FD is edge-triggered: it signals only that
EVENTS changed. So the owner drains the socket completely, and re-reads EVENTS after every send
(a send can consume the edge a pending receive would have produced) before it sleeps. Other
tasks never touch the socket: they queue frames with `send` and receive through `handle`.
"""

from collections import deque

import trio
import zmq


class SocketPump:
    def __init__(self, sock: zmq.Socket, burst: int = 256):
        self.sock = sock
        self._out: deque[list] = deque()
        self._sleeping: trio.CancelScope | None = None
        self._burst = burst  # messages handled before yielding to other tasks

    def send(self, frames: list) -> None:
        """Queues a multipart message; the owner task sends it."""
        self._out.append(frames)
        if self._sleeping is not None:
            self._sleeping.cancel()

    def _send_queued(self) -> None:
        sock = self.sock
        while self._out:
            try:
                sock.send_multipart(self._out[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # high-water mark: wait for POLLOUT
            self._out.popleft()

    async def run(self, handle=None) -> None:
        """Owner loop. `handle(frames)` is called for every message received; it must not
        block (spawn a task for real work)."""
        sock = self.sock
        fd = sock.getsockopt(zmq.FD)
        while True:
            self._send_queued()
            received = 0
            while handle is not None and received < self._burst:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handle(frames)
                received += 1
                self._send_queued()
            if received:
                await trio.lowlevel.checkpoint()
                continue
            events = sock.getsockopt(zmq.EVENTS)
            if handle is not None and events & zmq.POLLIN:
                continue
            if self._out and events & zmq.POLLOUT:
                continue
            with trio.CancelScope() as scope:
                self._sleeping = scope
                await trio.lowlevel.wait_readable(fd)
            self._sleeping = None
            if scope.cancelled_caught:
                await trio.lowlevel.checkpoint()
