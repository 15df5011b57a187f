"""The remote tier's connection to its bucket: the S3 store, whether it answers, and the worker
thread calls that find out.

Both halves of the tier (bluecached/tiers/remote.py, bluecached/tiers/remote_fetch.py) ask S3
through one `RemoteLink`, so a request of either that gets no answer marks the whole tier down
and one that gets an answer brings it back.
"""

from __future__ import annotations

import logging
import time

import trio

from .s3 import S3Error, S3Store

log = logging.getLogger("bluecached.tiers.remote")


class RemoteLink:
    def __init__(self, s3: S3Store, counters, on_recovered=lambda: None):
        self.s3 = s3
        self._counters = counters          # RemoteCounters: `errors` is counted here
        self._on_recovered = on_recovered  # the upload workers look at their queue again
        self.reachable = True              # optimistic until a request says otherwise
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self._up = trio.Event()
        self._up.set()

    def failed(self, e: Exception) -> None:
        """A request failed: counted and logged; no answer at all marks the tier down."""
        self._counters.errors += 1
        self.last_error, self.last_error_at = str(e), time.time()
        if isinstance(e, S3Error) and e.unreachable:
            if self.reachable:
                log.warning("remote tier unreachable, serving from local tiers: %s", e)
                self.reachable = False
                self._up = trio.Event()
        else:
            log.error("remote tier: %s", e)

    def answered(self) -> None:
        """A request got its answer: a tier marked down is back."""
        if not self.reachable:
            log.info("remote tier reachable again")
            self.reachable = True
            self._up.set()
            self._on_recovered()

    async def wait_up(self) -> None:
        await self._up.wait()

    async def call(self, fn, *args, limiter=None):
        """A blocking S3 call, in a worker thread."""
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    async def delete_quietly(self, key: str | None) -> None:
        if key is None:
            return
        try:
            await self.call(self.s3.delete, key)
        except S3Error as e:
            self.failed(e)

    async def probe(self) -> bool:
        try:
            await self.call(self.s3.probe)
        except S3Error as e:
            self.last_error, self.last_error_at = str(e), time.time()
            return False
        self.answered()
        return True
