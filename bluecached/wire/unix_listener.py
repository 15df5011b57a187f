"""A private unix SEQPACKET listener: the daemon's local sockets (control.seq, dma.sock)."""

import contextlib
import os
import socket

import trio


async def serve_private(path: str, handle, *, backlog: int = 128,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listens at `path` (mode 0600: only the daemon's user may connect, whatever the umask)
    and runs `handle(conn)` in a task per connection."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        await listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(backlog)
    task_status.started()
    async with trio.open_nursery() as nursery:
        try:
            while True:
                conn, _ = await listener.accept()
                nursery.start_soon(handle, conn)
        finally:
            listener.close()
