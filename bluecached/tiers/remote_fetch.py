"""The remote tier's read side: a placeholder's bytes fetched into DRAM and served chunk by
chunk as their CRC32Cs match (bluecached/arrival.py), and prefetching of looked-up files.

`RemoteTier` (bluecached/tiers/remote.py) owns one `RemoteFetcher` and hands it each file a
lookup found (a placeholder); the fetcher keeps them until they are read, fetched or expire.

- fetch: the first reader (or a prefetch) starts one; every reader waits on its arrival
  for the chunks it needs, without the content lock the fetch holds. A failed chunk fails
  the fetch and every reader still waiting (EIO); bytes are never served unchecked.
- prefetch: a lookup that finds a file queues the fetch of its bytes; `prefetch` of them run
  at once, in lookup order, while the prefetched-but-unread bytes stay under
  `prefetch_max_bytes` (and half of DRAM). With a slot free, the lookup itself asks with a
  GET and that GET's body is the prefetch. A prefetch takes only DRAM that is free or held
  by clean objects, never waits for room (it is dropped instead), and keeps what it fetched
  pinned in DRAM until it is read (or for a minute).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ..arrival import Arrival
from ..namespace import FsError, Inode
from .dram import CHUNK_SIZE
from .objects import chunk_count, views
from .s3 import Changed, ChecksumMismatch, S3Error

if TYPE_CHECKING:
    from .placement import Tiers
    from .remote import RemoteCounters, RemotePolicy, StoreView
    from .remote_link import RemoteLink

log = logging.getLogger("bluecached.tiers.remote")

PREFETCH_QUEUE_MAX = 4096    # looked-up placeholders waiting for a prefetch slot
PREFETCH_UNREAD_S = 60       # prefetched bytes nobody read stop counting against the bound
PREFETCH_WAKE_S = 5          # the prefetcher looks again this often: unread bytes age out
PLACEHOLDER_TTL_S = 600      # a looked-up, never-read placeholder is forgotten after this


class RemoteFetcher:
    def __init__(self, link: RemoteLink, policy: RemotePolicy, stats: RemoteCounters,
                 tiers: Tiers, store: StoreView, key_of: Callable[[Inode], str | None]):
        self.link = link
        self.policy = policy
        self.stats = stats
        self.tiers = tiers          # the local tiers: DRAM for the bytes, then write-behind
        self.store_view = store
        self.key_of = key_of        # a file's key now (it may have been renamed meanwhile)
        self._placeholders: dict[int, tuple[Inode, float, str]] = {}   # ino -> (node, since, key)
        self._prefetch_queue: deque[Inode] = deque()
        self._prefetching = 0
        self._prefetching_bytes = 0
        self._unread: dict[int, tuple[Inode, float]] = {}   # prefetched, not read: ino -> since
        self._prefetch_wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Fetches and prefetches run in this task's nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.prefetcher)
            task_status.started()

    # -- a file a lookup found -------------------------------------------------------------

    def reserve_opening(self) -> int:
        """Bytes a lookup GETs at once (the start of a prefetch) instead of a HEAD, holding a
        prefetch slot until `found` takes it or `release_opening` gives it back; or 0 (then a
        HEAD, no slot): only with a slot free and nothing queued before it."""
        policy = self.policy
        if (policy.prefetch <= 0 or self._prefetching >= policy.prefetch
                or self._prefetch_queue or self.unread_bytes() >= self.prefetch_budget()):
            return 0
        # an object up to the multipart threshold comes whole in this one GET (as a read's
        # fetch would have it); beyond, the rest in parallel ranges once the size is known
        s3 = self.link.s3
        length = max(s3.part_size, s3.multipart_threshold)
        self._prefetching += 1
        return max(CHUNK_SIZE, length // CHUNK_SIZE * CHUNK_SIZE)

    def release_opening(self, opened: tuple | None) -> None:
        """The lookup's GET started no prefetch after all: its answer and its slot go."""
        if opened is not None and opened[0] is not None:
            opened[0].close()
        self._prefetching -= 1
        self._wake_prefetcher()

    def found(self, node: Inode, key: str, opened: tuple | None) -> bool:
        """A lookup made a placeholder for `key`: its bytes are prefetched (from the lookup's
        GET if it had one). True if that GET's body and slot were taken."""
        self._placeholders[node.ino] = (node, trio.current_time(), key)
        if opened is not None:
            return self._prefetch_opened(node, opened)
        self._want_prefetch(node)
        return False

    def expire_placeholders(self) -> None:
        cutoff = trio.current_time() - PLACEHOLDER_TTL_S
        for ino, (node, since, _) in list(self._placeholders.items()):
            if node.parent is None or node.obj.remote_info is None:
                del self._placeholders[ino]
            elif not node.obj.busy and since < cutoff:
                del self._placeholders[ino]
                self.store_view.remove_object(node, "remote placeholder not read")

    def _prefetch_opened(self, node: Inode, opened: tuple) -> bool:
        """A lookup's GET found the file: its body becomes the start of a prefetch, within
        the bounds a queued one has. True if the prefetch took the body and the slot."""
        size = node.size
        if self.unread_bytes() + size > self.prefetch_budget():
            self._want_prefetch(node)   # waits for room in the queue, HEAD-style
            return False
        chunks = self.tiers.try_take_content(size)
        if chunks is None:   # DRAM pressure: leave it to the reader
            self.stats.prefetches_dropped += 1
            return False
        self._prefetching_bytes += size
        node.obj.arrival = Arrival(chunk_count(size))
        self._nursery.start_soon(self._fetch_task, node, node.obj.arrival, chunks, True, opened)
        return True

    # -- fetching a placeholder's bytes ----------------------------------------------------

    def start_fetch(self, node: Inode) -> Arrival:
        """A reader wants a placeholder's bytes: the fetch in flight (a prefetch's or another
        reader's), or a new one. Readers wait on the returned arrival, chunk by chunk."""
        obj = node.obj
        if obj.arrival is None:
            obj.arrival = Arrival(chunk_count(node.size))
            self._nursery.start_soon(self._fetch_task, node, obj.arrival, None, False)
        return obj.arrival

    async def _fetch_task(self, node: Inode, arrival: Arrival, chunks: list | None,
                          prefetch: bool, opened: tuple | None = None) -> None:
        obj = node.obj
        try:
            async with obj.content_lock():
                if (obj.remote_info is None or obj.chunks is not None
                        or (prefetch and node.parent is None)):
                    if chunks:   # a reader's load got there first, or it was removed
                        self.tiers.give_chunks(obj, chunks)
                    return
                if prefetch:
                    self.stats.prefetches += 1
                try:
                    await self._fetch(node, arrival, chunks, opened)
                    opened = None
                except FsError as e:   # counted and logged; the readers got EIO from arrival
                    opened = None   # get_into closed it, or _fetch did
                    log.info("%s of inode %d: %s", "prefetch" if prefetch else "fetch",
                             node.ino, e)
                    return
                if prefetch:
                    if arrival.was_read:
                        self.stats.prefetches_read += 1
                    else:
                        # pinned until read (or aged out): the evictor would otherwise take
                        # these first, as the blocks being read are the most recently used
                        self.tiers.pin(obj)
                        self._unread[node.ino] = (node, trio.current_time())
        except Exception:
            # A bug here must not end the daemon (this is a task of the fetcher's nursery)
            # with every object only DRAM holds: the failure is this file's, its readers get
            # EIO and the placeholder stays for the next read to try again.
            log.exception("%s of inode %d failed unexpectedly",
                          "prefetch" if prefetch else "fetch", node.ino)
            if arrival.failed is None:
                arrival.fail("the fetch failed unexpectedly")
        finally:
            if opened is not None and opened[0] is not None:
                opened[0].close()   # never handed to a download
            if obj.arrival is arrival:
                obj.arrival = None
            if not (arrival.complete or arrival.failed):
                arrival.abandon()   # nothing was fetched: readers go the usual way
            if prefetch:
                self._prefetching -= 1
                self._prefetching_bytes -= node.size
                self._wake_prefetcher()

    async def fetch(self, node: Inode) -> None:
        """Pulls a placeholder's bytes into DRAM for an operation that holds the content lock
        and needs them all (a write, a truncation, a checksum)."""
        await self._fetch(node, Arrival(chunk_count(node.size)), None)

    async def _fetch(self, node: Inode, arrival: Arrival, chunks: list | None,
                     opened: tuple | None = None) -> None:
        """Pulls a placeholder's bytes into DRAM (then written behind to NVMe like any new
        object), into `chunks` if given (a prefetch's), marking each chunk in `arrival` once
        its CRC32C matched. Caller holds the content lock. On any failure the placeholder is
        removed (the next lookup asks again) and readers get EIO, never unchecked bytes."""
        store, tiers, obj = self.store_view, self.tiers, node.obj
        info = obj.remote_info
        key = self._placeholders.pop(node.ino, (None, None, self.key_of(node)))[2]
        size = node.size

        def failed(why: str, err: int = errno.EIO) -> FsError:
            arrival.fail(why, err)
            if chunks is not None:   # later if a reader still copies from them
                tiers.give_chunks(obj, chunks)
            self.stats.fetch_failures += 1
            return FsError(err, f"remote tier: {why}")

        if not self.link.reachable:
            if opened is not None and opened[0] is not None:
                opened[0].close()
            store.remove_object(node, "remote tier unreachable")
            raise failed(f"unreachable: {self.link.last_error}")
        if chunks is None:
            chunks = await tiers.take_content(size)
        arrival.started(chunks)
        token = trio.lowlevel.current_trio_token()

        def checked(index: int) -> None:   # a worker thread: hand it to the event loop
            token.run_sync_soon(arrival.mark, index)

        problem, err = None, errno.EIO
        started = time.perf_counter()
        try:
            if key is None:
                raise Changed("the file lost its name")
            crcs = await self.link.call(self.link.s3.get_into, key, info, views(chunks, 0, size),
                                      CHUNK_SIZE, checked, opened)
        except ChecksumMismatch as e:
            self.stats.checksum_failures += 1
            log.error("remote object %s failed its checksum, deleting it: %s", key, e)
            problem = f"checksum mismatch: {e}"
            await self.link.delete_quietly(key)
        except Changed as e:
            problem = f"remote object went away: {e}"
            if key is not None:
                # Replaced or deleted by another host since the lookup: the bytes this file
                # named are nowhere now. ESTALE, as NFS says of a file handle whose file
                # went on the server; the next lookup finds what the name holds now. (With
                # no name, it was removed here: unlinked, or a failed check; EIO as ever.)
                err = errno.ESTALE
        except S3Error as e:
            self.link.failed(e)
            problem = str(e)
        except BaseException:
            failed("the fetch was interrupted")
            raise
        finally:
            self.stats.fetch_seconds += time.perf_counter() - started
        if problem is not None:
            store.remove_object(node, "remote fetch failed")
            raise failed(problem, err)
        self.link.answered()
        if not store.holds(node):   # unlinked and forgotten meanwhile
            arrival.fail("the file was removed while it was fetched")
            tiers.give_chunks(obj, chunks)
            raise FsError(errno.ENOENT, "the file was removed while it was fetched")
        obj.chunks = chunks   # past EOF is zeros: the memfd ends there
        obj.remote_info = None
        if obj.arrival is arrival:
            obj.arrival = None
        arrival.finish()
        if key == self.key_of(node):   # else it was renamed: upload it under its new name
            obj.remote_version = obj.version
        obj.dirty = True
        tiers.dirty_bytes += size
        tiers.mark_resident(node)
        self.stats.fetches += 1
        self.stats.fetch_bytes += size
        tiers.note_crcs(node, crcs)   # checked on arrival: write-behind reuses them
        tiers.queue_writeback(node)

    # -- prefetch --------------------------------------------------------------------------

    def _want_prefetch(self, node: Inode) -> None:
        if self.policy.prefetch <= 0:
            return
        if len(self._prefetch_queue) >= PREFETCH_QUEUE_MAX:
            self.stats.prefetches_dropped += 1
            return
        self._prefetch_queue.append(node)
        self._wake_prefetcher()

    def _wake_prefetcher(self) -> None:
        self._prefetch_wake.set()
        self._prefetch_wake = trio.Event()

    def note_read(self, node: Inode) -> None:
        """A client read the object: prefetched bytes it was holding are now in use."""
        if self._release_unread(node.ino):
            self.stats.prefetches_read += 1

    def _release_unread(self, ino: int) -> bool:
        entry = self._unread.pop(ino, None)
        if entry is None:
            return False
        self.tiers.unpin(entry[0].obj)
        self._wake_prefetcher()
        return True

    def prefetch_budget(self) -> int:
        return min(self.policy.prefetch_max_bytes, self.tiers.dram.capacity // 2)

    def unread_bytes(self) -> int:
        """Bytes prefetched and not read yet (those evicted, removed or too old no longer
        count)."""
        cutoff = trio.current_time() - PREFETCH_UNREAD_S
        total = self._prefetching_bytes
        for ino, (node, since) in list(self._unread.items()):
            if node.parent is None or node.obj.chunks is None or since < cutoff:
                self._release_unread(ino)
            else:
                total += node.size
        return total

    @staticmethod
    def _still_placeholder(node: Inode) -> bool:
        obj = node.obj
        return (node.parent is not None and obj is not None and obj.remote_info is not None
                and obj.chunks is None and obj.arrival is None
                and not (obj.lock is not None and obj.lock.locked()))

    async def prefetcher(self) -> None:
        """Starts queued prefetches in lookup order while slots and the byte bound allow."""
        while True:
            wake = self._prefetch_wake
            while self._prefetch_queue and self._prefetching < self.policy.prefetch:
                node = self._prefetch_queue[0]
                if not self._still_placeholder(node):   # read, removed or being fetched
                    self._prefetch_queue.popleft()
                    continue
                if not self.link.reachable:
                    self._prefetch_queue.popleft()
                    self.stats.prefetches_dropped += 1
                    continue
                unread = self.unread_bytes()
                if unread + node.size > self.prefetch_budget():
                    if unread or self._prefetching:
                        break   # waits until something prefetched is read (or ages out)
                    self._prefetch_queue.popleft()   # larger than the bound by itself
                    self.stats.prefetches_dropped += 1
                    continue
                self._prefetch_queue.popleft()
                chunks = self.tiers.try_take_content(node.size)
                if chunks is None:   # DRAM pressure: leave it to the reader
                    self.stats.prefetches_dropped += 1
                    continue
                self._prefetching += 1
                self._prefetching_bytes += node.size
                node.obj.arrival = Arrival(chunk_count(node.size))
                self._nursery.start_soon(self._fetch_task, node, node.obj.arrival, chunks, True)
            with trio.move_on_after(PREFETCH_WAKE_S):   # unread bytes also age out
                await wake.wait()

