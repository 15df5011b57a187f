"""At most one log line per interval for a failure that can repeat thousands of times a
second (a client sending garbage, a full disk), with a count of those left unsaid."""

import time


class LogLimiter:
    def __init__(self, interval: float, clock=time.monotonic):
        self.interval = interval
        self._clock = clock
        self._next = -float("inf")
        self._unsaid = 0

    def allow(self) -> str | None:
        """None: stay quiet this time. Else log now, appending the string returned (empty, or
        how many were left unsaid since the last line)."""
        now = self._clock()
        if now < self._next:
            self._unsaid += 1
            return None
        note = f" ({self._unsaid} more since the last message)" if self._unsaid else ""
        self._next = now + self.interval
        self._unsaid = 0
        return note
