"""sd_notify that can never stall the event loop.

sdnotify's socket blocks when the receiver's datagram queue is full (a supervisor that reads
slowly, or not at all): a daemon would freeze inside a status update. Notifications are
advisory, so a full queue drops them instead.
"""

import sdnotify


class Notifier:
    def __init__(self):
        self._notifier = sdnotify.SystemdNotifier()
        sock = self._notifier.socket
        if sock is not None:
            sock.setblocking(False)
        self._last_status = None

    def notify(self, message: str) -> None:
        self._notifier.notify(message)   # swallows errors, EAGAIN included

    def status(self, text: str, watchdog: bool = False) -> None:
        """STATUS= only when it changed (plus WATCHDOG=1 when asked)."""
        lines = []
        if text != self._last_status:
            lines.append(f"STATUS={text}")
            self._last_status = text
        if watchdog:
            lines.append("WATCHDOG=1")
        if lines:
            self.notify("\n".join(lines))
