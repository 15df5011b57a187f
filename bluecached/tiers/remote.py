"""The remote tier: an S3 bucket that many hosts share, below DRAM and NVMe.

A file's S3 key is its path under the mount (after an optional prefix); the connectors name
blocks by content hash, so two hosts writing one name hold the same bytes. What this module
does, all on the event loop with the blocking S3 calls in worker threads (bluecached/tiers/s3.py):

- uploads: complete files (writers gone, final name) are admitted by policy (all, reread, age)
  into a bounded queue; past the bound they are dropped and counted. Workers upload them while
  the object is pinned (writes to it wait; reads do not).
- lookups that miss locally ask S3 (a HEAD, or a GET that starts a prefetch, and at the
  same time a one-key LIST for a directory) and leave a placeholder inode whose bytes are
  fetched, CRC32C checked chunk by chunk, on first read or by a prefetch
  (bluecached/tiers/remote_fetch.py); misses are kept in a short negative cache so a connector's
  per-block lookups do not each cost a round trip, and the keys a LIST shows are remembered a
  while, so the directory levels below it need no request and a file seen there only a HEAD.
- failures: a request that gets no answer marks the tier down; lookups then miss at once,
  uploads wait in the queue, and a probe brings the tier back. Local tiers never wait on it.
- capacity: a periodic listing deletes objects past `max_age`, then the oldest past
  `max_bytes`. Local eviction never deletes remote copies; unlink does (it is a POSIX unlink
  of a shared file).

The tier sees the store above it only as a `StoreView` and the local tiers as `Tiers`, both
given at construction (bluecached/compose.py); it asks S3 through a `RemoteLink`
(bluecached/tiers/remote_link.py), which its `RemoteFetcher` shares.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from ..arrival import Arrival
from ..namespace import ROOT_INO, TMP_SUFFIX, FsError, Inode
from . import index
from .dram import CHUNK_SIZE
from .objects import views
from .remote_fetch import RemoteFetcher
from .remote_link import RemoteLink
from .s3 import SIDECAR_DIR, RemoteObject, S3Error, S3Store, object_metadata, xattrs_metadata

if TYPE_CHECKING:
    from .placement import Tiers

log = logging.getLogger("bluecached.tiers.remote")

NEGATIVE_CACHE_MAX = 65536
LISTED_TTL_S = 30            # keys seen in a LIST are trusted this long (files: HEAD only)
MAINTAIN_INTERVAL_S = 5
MAX_KEY_BYTES = 1024                       # S3's limit on a key, in UTF-8 bytes
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")


# trio 0.22 (Debian's) names it `cancellable`; later versions `abandon_on_cancel`
_ABANDON = ("abandon_on_cancel" if "abandon_on_cancel" in
            inspect.signature(trio.to_thread.run_sync).parameters else "cancellable")


async def _abandonable_thread(fn, *args):
    """A worker-thread call whose result may stop mattering: cancelling the caller leaves the
    thread to finish on its own."""
    return await trio.to_thread.run_sync(fn, *args, **{_ABANDON: True})


@dataclass
class RemoteCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    negative_hits: int = 0
    listed_hits: int = 0         # directory lookups a recent LIST answered (no request)
    opening_gets: int = 0        # lookups that asked with a GET of the first bytes (no HEAD)
    skipped_down: int = 0        # lookups answered as a miss because the tier was down
    uploads: int = 0
    upload_bytes: int = 0
    upload_failures: int = 0
    upload_seconds: float = 0.0  # wall time in S3 upload calls (PUT or multipart)
    uploads_dropped: int = 0     # admitted past the queue bound
    fetches: int = 0
    fetch_bytes: int = 0
    fetch_failures: int = 0
    fetch_seconds: float = 0.0   # wall time in S3 downloads (GETs and the CRC32C check)
    prefetches: int = 0          # fetches started by a lookup (also counted in fetches)
    prefetches_dropped: int = 0  # not done: no DRAM room without waiting, queue full, down
    prefetches_read: int = 0     # prefetched objects a client then read
    checksum_failures: int = 0
    deletes: int = 0             # unlinks propagated
    capacity_deletes: int = 0    # removed by max_bytes / max_age
    errors: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RemotePolicy:
    prefix: str = ""
    admission: str = "all"           # all | reread | age
    admission_age: float = 30.0
    queue_max: int = 1024
    upload_workers: int = 2
    negative_ttl: float = 2.0
    retry_interval: float = 5.0
    max_bytes: int = 0               # 0: unbounded
    max_age: float = 0.0             # 0: unbounded
    enforce_interval: float = 60.0
    low_fraction: float = 0.9        # max_bytes enforcement deletes down to this fraction
    prefetch: int = 2                # concurrent prefetches; 0: fetch on first read only
    prefetch_max_bytes: int = 256 << 20
    describe: dict = field(default_factory=dict)   # endpoint, bucket, region for status


class StoreView(Protocol):
    """What the remote tier may ask of the store above it (bluecached.store.RemoteView):
    names, the files and directories it finds, and removal. It knows nothing more of it."""

    def lookup(self, parent: int, name: bytes) -> Inode:
        """The local namespace's entry (FsError ENOENT if none)."""

    def directory_path(self, ino: int) -> bytes:
        """A directory's path under the mount (b"" once it is removed); FsError if `ino`
        is no directory."""

    def path_of(self, node: Inode) -> bytes:
        """A file's path under the mount (b"" once it has no name)."""

    def holds(self, node: Inode) -> bool:
        """Whether `node` is still in the namespace (not unlinked and forgotten)."""

    def is_temporary(self, node: Inode) -> bool:
        """Whether every name of the file is a writer's temporary (`*.tmp`)."""

    def add_directory(self, parent: int, name: bytes) -> Inode:
        """A directory the remote tier has, made locally like its parent."""

    def add_placeholder(self, parent: int, name: bytes, info: RemoteObject) -> Inode:
        """A file the remote tier has: its size now, its bytes on first read."""

    def remove_object(self, node: Inode, reason: str) -> None:
        """The cache removes the file (every name of it), telling the hosts."""


class RemoteTier:
    def __init__(self, s3: S3Store, policy: RemotePolicy, tiers: Tiers, store: StoreView):
        self.s3 = s3
        self.policy = policy
        self.tiers = tiers                # the local tiers: uploads read their DRAM and NVMe
        self.store_view = store
        self.stats = RemoteCounters()
        self.link = RemoteLink(s3, self.stats, on_recovered=self._wake)
        self.fetcher = RemoteFetcher(self.link, policy, self.stats, tiers, store, self.key_of)
        self.remote_bytes: int | None = None      # as of the last capacity listing
        self.remote_objects: int | None = None
        self._queue: deque[tuple[Inode, int]] = deque()
        self._queued_inos: set[int] = set()
        self._delayed: deque[tuple[float, Inode]] = deque()   # admission by age
        self._work = trio.Event()
        self._negative: dict[str, float] = {}
        self._inflight: dict[str, trio.Event] = {}
        self._upload_limiter = trio.CapacityLimiter(max(1, policy.upload_workers))
        self._listed: dict[str, tuple[float, bool]] = {}   # key -> (expiry, is a directory)
        self._file_dirs: dict[int, None] = {}   # directories where a lookup found a file
        self._sidecars: set[str] = set()   # keys this host uploaded with an xattr sidecar
        self._nursery: trio.Nursery | None = None

    @property
    def reachable(self) -> bool:
        return self.link.reachable

    @property
    def last_error(self) -> str | None:
        return self.link.last_error

    # -- keys ------------------------------------------------------------------------------

    def key_for(self, path: bytes) -> str | None:
        """S3 key of a mount path (b"/a/b"); None (the file stays local, and a lookup of
        it costs no request) where there can be none: the root, a path that is not UTF-8,
        one with a control character (S3 advises against them, and a LIST of such a prefix
        got HTTP 500 from Ceph's radosgw at every lookup, each logged with the raw
        characters: stress-ng's filename stressor), or a key past S3's 1024 bytes."""
        rel = path.lstrip(b"/")
        if not rel or _CONTROL.search(rel):
            return None
        try:
            key = self.policy.prefix + rel.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return key if len(key.encode()) <= MAX_KEY_BYTES else None

    def key_of(self, node: Inode) -> str | None:
        """A file's key: its path. None for a file with hard links: which path would it be?
        Such a file stays local (a copy it had goes when it gets its second name)."""
        if node.parent is None or node.extra is not None:
            return None
        return self.key_for(self.store_view.path_of(node))

    def sidecar_key(self, key: str) -> str:
        """Where the attributes of the object at `key` go when too large for its metadata
        (s3.SIDECAR_DIR: a directory no lookup can name)."""
        rel = key[len(self.policy.prefix):].encode()
        return self.policy.prefix + SIDECAR_DIR + "/" + hashlib.sha256(rel).hexdigest()

    async def _xattrs_of(self, key: str, info: RemoteObject) -> tuple[bool, dict | None]:
        """(usable, attributes) of a found object: its sidecar fetched if it has one. Not
        usable: attributes that do not decode, or a sidecar missing or not the one named."""
        if info.xattrs_bad:
            return False, None
        if info.xattrs_sidecar is None:
            return True, info.xattrs
        table = await self.link.call(self.s3.get_sidecar, self.sidecar_key(key),
                                     info.xattrs_sidecar)
        return table is not None, table

    def _wake(self) -> None:
        self._work.set()
        self._work = trio.Event()

    # -- what the store asks of the fetcher -------------------------------------------------

    def start_fetch(self, node: Inode) -> Arrival:
        """A reader wants a placeholder's bytes: it waits on the returned arrival."""
        return self.fetcher.start_fetch(node)

    async def fetch(self, node: Inode) -> None:
        """All of a placeholder's bytes into DRAM; the caller holds the content lock."""
        await self.fetcher.fetch(node)

    def note_read(self, node: Inode) -> None:
        self.fetcher.note_read(node)

    # -- lookups ---------------------------------------------------------------------------

    def _negative_hit(self, key: str) -> bool:
        expiry = self._negative.get(key)
        if expiry is None:
            return False
        if expiry > trio.current_time():
            return True
        del self._negative[key]
        return False

    def _remember_miss(self, key: str) -> None:
        if len(self._negative) >= NEGATIVE_CACHE_MAX:
            now = trio.current_time()
            self._negative = {k: t for k, t in self._negative.items() if t > now}
            if len(self._negative) >= NEGATIVE_CACHE_MAX:
                self._negative.clear()
        self._negative[key] = trio.current_time() + self.policy.negative_ttl

    async def lookup(self, parent: int, name: bytes) -> Inode:
        """A name the namespace lacks: a placeholder (file) or directory if S3 has it, else
        ENOENT. Never raises anything else for remote trouble: the caller sees a miss."""
        store = self.store_view
        ppath = store.directory_path(parent)
        key = self.key_for(ppath + b"/" + name) if ppath or parent == ROOT_INO else None
        # A writer's temporary is never uploaded: asking for one (the kernel looks a name up
        # before it creates it, at every store) cost each store an S3 round trip.
        if key is None or name.endswith(TMP_SUFFIX):
            raise FsError(errno.ENOENT)
        self.stats.lookups += 1
        if not self.reachable:
            self.stats.skipped_down += 1
            raise FsError(errno.ENOENT)
        if self._negative_hit(key):
            self.stats.negative_hits += 1
            raise FsError(errno.ENOENT)
        pending = self._inflight.get(key)
        if pending is not None:   # another lookup of this key is asking S3 already
            await pending.wait()
            return store.lookup(parent, name)
        done = self._inflight[key] = trio.Event()
        try:
            return await self._ask(parent, name, key)
        finally:
            del self._inflight[key]
            done.set()

    def _listed_as(self, key: str) -> bool | None:
        """True: a recent LIST showed a key below `key/`; False: it showed `key` itself."""
        entry = self._listed.get(key)
        if entry is None:
            return None
        if entry[0] > trio.current_time():
            return entry[1]
        del self._listed[key]
        return None

    def _remember_listed(self, first: str) -> None:
        """A LIST showed `first`: its directory levels exist and it is a file."""
        if len(self._listed) >= NEGATIVE_CACHE_MAX:
            self._listed.clear()
        expiry = trio.current_time() + LISTED_TTL_S
        self._listed[first] = (expiry, False)
        cut = first.find("/", len(self.policy.prefix))
        while cut != -1:
            self._listed[first[:cut]] = (expiry, True)
            cut = first.find("/", cut + 1)

    async def _head_and_list(self, key: str, head) -> tuple:
        """(head(key), first key under key/), the two requests in flight together. A HEAD
        that finds a file answers at once: the LIST (is it also a directory?) is then left to
        finish on its own, as a file wins over a directory of the same name anyway."""
        out: dict[str, object] = {}

        async def ask(what: str, fn, arg) -> None:
            try:
                out[what] = await _abandonable_thread(fn, arg)
            except S3Error as e:   # kept: one S3Error for the caller, not an exception group
                out[what] = e
            if what == "head" and out[what] is not None and not isinstance(out[what], S3Error):
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "head", head, key)
            nursery.start_soon(ask, "list", self.s3.first_key, key + "/")
        for value in out.values():
            if isinstance(value, S3Error):
                raise value
        return out["head"], out.get("list")

    async def _ask(self, parent: int, name: bytes, key: str) -> Inode:
        store = self.store_view
        listed = self._listed_as(key)
        # with a prefetch slot free, the slot is this lookup's until it knows the size
        opening = self.fetcher.reserve_opening() if listed is not True else 0
        if opening:
            self.stats.opening_gets += 1
            head = functools.partial(self.s3.open_object, length=opening)
        else:
            head = self.s3.head
        opened = None     # (body, bytes in it) of the lookup's GET, until a prefetch takes it
        slot_taken = False
        try:
            try:
                if listed is True:
                    info, first, is_dir = None, None, True
                    self.stats.listed_hits += 1
                elif listed is False or parent in self._file_dirs:
                    # a file as far as a LIST knows, or in a directory of files: the LIST only
                    # if there is no such file
                    info = await self.link.call(head, key)
                    first = None if info else await self.link.call(self.s3.first_key, key + "/")
                    is_dir = info is None and first is not None
                else:
                    info, first = await self._head_and_list(key, head)
                    is_dir = info is None and first is not None
                if is_dir and first is not None:
                    self._remember_listed(first)
            except S3Error as e:
                self.link.failed(e)
                self.stats.misses += 1
                raise FsError(errno.ENOENT) from None
            if opening and info is not None:
                info, opened = info[0], info[1:]
            table = None
            if info is not None:
                try:
                    usable, table = await self._xattrs_of(key, info)
                except S3Error as e:
                    self.link.failed(e)
                    self.stats.misses += 1
                    raise FsError(errno.ENOENT) from None
                if not usable:   # never a file with attributes that are not its own
                    log.warning("remote object %s: its attributes are missing or damaged; "
                                "not served", key)
                    info = None
            self.link.answered()
            try:
                return store.lookup(parent, name)   # created here while we asked
            except FsError:
                pass
            if info is None and not is_dir:
                self.stats.misses += 1
                self._remember_miss(key)
                raise FsError(errno.ENOENT)
            self.stats.hits += 1
            if is_dir:
                return store.add_directory(parent, name)
            self._note_file_dir(parent)
            node = store.add_placeholder(parent, name, info)
            node.xattrs = table
            slot_taken = self.fetcher.found(node, key, opened)
            return node
        finally:
            if opening and not slot_taken:   # no prefetch after all: drop the answer
                self.fetcher.release_opening(opened)

    def _note_file_dir(self, parent: int) -> None:
        if len(self._file_dirs) >= NEGATIVE_CACHE_MAX:
            self._file_dirs.clear()
        self._file_dirs[parent] = None

    # -- uploads ---------------------------------------------------------------------------

    def uploaded(self, node: Inode) -> bool:
        obj = node.obj
        return obj is not None and obj.remote_version == obj.version

    def admit(self, node: Inode, reason: str) -> None:
        """A complete file is a candidate for upload (`reason`: written, read, startup)."""
        obj = node.obj
        if (obj is None or obj.writers or node.parent is None or node.extra is not None
                or self.uploaded(node)
                or obj.remote_info is not None or self.store_view.is_temporary(node)
                or node.ino in self._queued_inos):
            return
        policy = self.policy.admission
        if (policy == "reread") != (reason == "read"):
            return   # reads admit only under reread, and only reads do
        if policy == "age" and reason != "aged":
            self._delayed.append((trio.current_time() + self.policy.admission_age, node))
            return
        if len(self._queue) >= self.policy.queue_max:
            self.stats.uploads_dropped += 1
            if self.stats.uploads_dropped in (1, 10, 100) or not self.stats.uploads_dropped % 1000:
                log.info("remote upload queue full (%d): %d uploads dropped so far",
                         self.policy.queue_max, self.stats.uploads_dropped)
            return
        self._queue.append((node, obj.version))
        self._queued_inos.add(node.ino)
        self._wake()

    def admit_persisted(self) -> None:
        """At start: files on NVMe the journal does not record as uploaded (the queue is not
        persisted), most recently used first."""
        for node in reversed(list(self.tiers.lru_nvme.values())):
            self.admit(node, "startup")

    def queue_length(self) -> int:
        return len(self._queue)

    async def upload_worker(self) -> None:
        while True:
            while not self._queue or not self.reachable:
                await (self.link.wait_up() if not self.reachable else self._work.wait())
            node, version = self._queue.popleft()
            self._queued_inos.discard(node.ino)
            await self._upload(node, version)

    async def _upload(self, node: Inode, version: int) -> None:
        tiers, obj = self.tiers, node.obj
        key = self.key_of(node)
        if obj.version != version or key is None or self.uploaded(node) or obj.writers:
            return
        async with obj.content_lock():
            while obj.uploading is not None:   # queued again while its upload ran (a rename,
                await obj.uploading.wait()     # a change of attributes): one at a time
            if obj.version != version or node.parent is None or self.uploaded(node):
                return
            if obj.chunks is None:
                try:
                    await tiers.promote(node)
                except FsError as e:
                    self.stats.upload_failures += 1
                    log.error("upload of %s: cannot read it locally: %s", key, e)
                    return
            body = views(obj.chunks, 0, node.size)
            known = obj.crcs if obj.persisted and not obj.dirty else None   # NVMe's, current
            table = node.xattrs   # never changed in place (xattrs.py): compared below
            node_size = node.size
            tiers.pin(obj)
            obj.uploading = trio.Event()
        started = time.perf_counter()
        try:
            try:
                crcs = await self.link.call(self.s3.put, key, body, CHUNK_SIZE, known, table,
                                            self.sidecar_key(key), limiter=self._upload_limiter)
            except S3Error as e:
                self.link.failed(e)
                if e.unreachable and obj.version == version and node.parent is not None:
                    self._queue.appendleft((node, version))   # keep it for when S3 is back
                    self._queued_inos.add(node.ino)
                else:
                    self.stats.upload_failures += 1
                return
            finally:
                self.stats.upload_seconds += time.perf_counter() - started
            self.link.answered()
            self.stats.uploads += 1
            self.stats.upload_bytes += node.size
            self._negative.pop(key, None)
            if table and xattrs_metadata(table, object_metadata(node_size, crcs, CHUNK_SIZE))[1]:
                self._sidecars.add(key)   # its attributes went to a sidecar: it goes with it
            if obj.version != version or self.key_of(node) != key or node.xattrs is not table:
                # Renamed, unlinked, rewritten or its attributes changed meanwhile. Deleted while
                # this upload still holds `uploading`: the next upload of the object (same key
                # after a change of attributes) must not start before, or this deletes its copy.
                await self._delete(key)
                return
        finally:
            tiers.unpin(obj)
            done, obj.uploading = obj.uploading, None
            done.set()
        obj.remote_version = version
        if obj.persisted:
            tiers.log(index.remote_record(node.ino))
        elif known is None:
            tiers.note_crcs(node, crcs)   # write-behind, still to come, needs no pass of its own

    # -- changes made by clients -----------------------------------------------------------

    def forget_copy(self, node: Inode, key: str | None, renamed: bool = False) -> None:
        """A client unlinked or renamed a file: its remote copy under the old name goes (a
        renamed placeholder keeps it: its bytes are still to be fetched from there)."""
        obj = node.obj
        if obj is None or key is None or (renamed and obj.remote_info is not None):
            return
        had_copy = self.uploaded(node) or obj.remote_info is not None
        if obj.remote_info is not None and obj.remote_info.xattrs_sidecar is not None:
            self._sidecars.add(key)
        obj.remote_version = -1
        obj.remote_info = None
        if had_copy:
            self.stats.deletes += 1
            self._remember_miss(key)
            self._nursery.start_soon(self._delete, key)

    async def _delete(self, key: str) -> None:
        """Deletes an object, then its attributes' sidecar if it may have one."""
        await self.link.delete_quietly(key)
        if key in self._sidecars:
            self._sidecars.discard(key)
            await self.link.delete_quietly(self.sidecar_key(key))

    # -- background ------------------------------------------------------------------------

    async def maintain(self) -> None:
        """Probes while down, admits aged files, expires idle placeholders, bounds capacity."""
        last_enforce = -1e9
        last_probe = -1e9
        while True:
            await trio.sleep(min(MAINTAIN_INTERVAL_S, self.policy.retry_interval,
                                 self.policy.admission_age or MAINTAIN_INTERVAL_S))
            now = trio.current_time()
            if not self.reachable and now - last_probe >= self.policy.retry_interval:
                last_probe = now
                await self.probe()
            while self._delayed and self._delayed[0][0] <= now:
                _, node = self._delayed.popleft()
                self.admit(node, "aged")
            self.fetcher.expire_placeholders()
            self.fetcher.unread_bytes()   # unpins prefetched objects that aged out unread
            bounded = self.policy.max_bytes or self.policy.max_age
            if bounded and self.reachable and now - last_enforce >= self.policy.enforce_interval:
                last_enforce = now
                await self.enforce_capacity()

    async def probe(self) -> bool:
        return await self.link.probe()

    async def enforce_capacity(self) -> dict:
        """Deletes objects under the prefix older than max_age, then the oldest until the
        total is at most low_fraction * max_bytes. Returns what it did."""
        policy = self.policy
        try:
            objects = await self.link.call(lambda: list(self.s3.list(policy.prefix)))
        except S3Error as e:
            self.link.failed(e)
            return {"error": str(e)}
        objects.sort(key=lambda o: o[2])   # oldest first
        doomed = []
        if policy.max_age:
            cutoff = time.time() - policy.max_age
            while objects and objects[0][2] < cutoff:
                doomed.append(objects.pop(0))
        total = sum(o[1] for o in objects)
        if policy.max_bytes and total > policy.max_bytes:
            while objects and total > policy.low_fraction * policy.max_bytes:
                o = objects.pop(0)
                total -= o[1]
                doomed.append(o)
        for key, _, _ in doomed:
            await self.link.delete_quietly(key)
        self.stats.capacity_deletes += len(doomed)
        self.remote_bytes, self.remote_objects = total, len(objects)
        if doomed:
            log.info("remote tier: deleted %d objects (%d bytes) to stay within its bounds",
                     len(doomed), sum(o[1] for o in doomed))
        return {"deleted": len(doomed), "bytes": total, "objects": len(objects)}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.fetcher.run)
            if not await self.probe():
                self.link.failed(S3Error(self.last_error or "no answer", unreachable=True))
            for _ in range(max(1, self.policy.upload_workers)):
                nursery.start_soon(self.upload_worker)
            nursery.start_soon(self.maintain)
            task_status.started()

    # -- reporting -------------------------------------------------------------------------

    async def close(self) -> None:
        """The S3 client's connection pool: closed in a worker thread, it may block."""
        await trio.to_thread.run_sync(self.s3.close)

    def status(self) -> dict:
        return {**self.policy.describe, "prefix": self.policy.prefix,
                "reachable": self.reachable, "admission": self.policy.admission,
                "queue": len(self._queue), "queue_max": self.policy.queue_max,
                "dropped": self.stats.uploads_dropped, "last_error": self.last_error,
                "last_error_age_s": (round(time.time() - self.link.last_error_at, 1)
                                     if self.link.last_error_at else None)}

    def tier_stats(self) -> dict:
        s = self.stats
        return {"bytes": self.remote_bytes or 0, "capacity_bytes": self.policy.max_bytes,
                "objects": self.remote_objects or 0, "hits": s.fetches, "misses": s.misses,
                "evictions": s.capacity_deletes, "bytes_in": s.upload_bytes}

