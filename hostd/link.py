"""hostd's link to bluecached: the fusefs `Cache` over the control protocol.

POSIX bytes go through staging slots: 1 MiB pieces of one sealed memfd registered with the
daemon's DMA engine. A write's bytes reach a slot one of two ways: the kernel reads the request
straight into it (native/fuse_shim.c, fusefs/inplace.py: `write_in_slot`), or, where that cannot
work, pyfuse3 hands over a copy that `write` copies into a slot (counted in `bytes_copied`);
either way the daemon is asked to pull it. A read asks the daemon to push into a slot and
hands the slot to the kernel. With `mount.write_ack: staged` a write is answered once it
is in its slot and the daemon call goes on in the background (hostd/inflight.py says what
waits for it); a write that then fails is reported at flush (close) and the daemon drops the
file, so no reader gets the bytes it is missing.

The daemon may restart under us. A health task notices (a failed ping, or a request answered
"say hello first"), wakes every waiting request, and reconnects: new handshake, staging
re-registered, open handles re-opened by inode on first use. Requests that are safe to repeat
wait for the reconnection up to `request_timeout`; the others fail with EIO, since whether the
dead daemon applied them is unknown.
"""

import contextvars
import ctypes
import errno
import logging
import math
import mmap
import os
import sys
from dataclasses import dataclass

import pyfuse3
import trio

from bluecached.wire.client import AsyncClient, RegionChannel, RemoteError, SharedRegion
from fusefs.cache import Attr

from .doca_export import DocaSetupError, HostExporter
from .inflight import WritesInFlight
from .kept_backings import KeptBackings
from .readahead import ReadAhead

log = logging.getLogger("hostd.link")

SLOT_SIZE = 1 << 20
# A slot's payload is page aligned, with a page before it for a FUSE write request's header and
# one after it for the rest of libfuse's receive buffer (requests are read into slots, see
# native/fuse_shim.c).
SLOT_HEAD = mmap.PAGESIZE
SLOT_STRIDE = SLOT_HEAD + SLOT_SIZE + mmap.PAGESIZE
PING_INTERVAL = 1.0
HUGE_PAGE = 2 << 20
LARGE_BUFFERS = 16   # reads larger than a slot in flight at once, read-ahead's included
# pyfuse3 >= 3.3 replies to a read from any buffer; Debian's 3.2 needs bytes.
_READ_TAKES_BUFFER = tuple(int(x) for x in pyfuse3.__version__.split(".")[:2]) >= (3, 3)

_IDEMPOTENT = {"lookup", "getattr", "read", "write", "write_batch", "readdir", "statfs", "open",
               "flush", "fsync", "ping", "forget", "discard", "readlink"}
_IDEMPOTENT |= {"getxattr", "listxattr"}   # reads of extended attributes
MAX_BATCH = 64   # staged writes per write_batch message
# A reader's RELEASE reaches hostd just before its next LOOKUP or OPEN (close(2), then the
# next file). Forwarded at once, bluecached's work on it (0.1-0.3 ms after the idle of a read,
# on the vCPU the lookup then waits for) came first: ad hoc, 2-core VM, one vLLM reader of NVMe
# hits, LOOKUP and OPEN together 1.8-1.9 ms with, 1.35-1.6 ms without. So a read-only handle's
# release waits this long, and read-side calls overtake it; any other call sends the waiting
# releases first (_overtakes), so nothing a release changes is seen out of order.
RELEASE_DELAY_S = 0.005
# The calls whose answers no reader's release changes: those may overtake a waiting release.
# (statfs may not: an unlinked file's space comes back with its last release.)
# (release: the forwarder's own, sent in order.)
_OVERTAKES_RELEASES = {"lookup", "getattr", "read", "readdir", "readlink", "getxattr",
                       "listxattr", "ping", "backing", "release"}   # and read-only opens
# `region=STAGING` in a call: hostd's staging region, under the id the daemon the call reaches
# knows it by (a restart registers it again under a new one; a call waiting it out must not
# name the old daemon's id).
STAGING = object()
# The deadline of the DaemonLink.call running in this task (calls made inside it share it).
_CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "bluecache_call_deadline", default=None)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _writable(flags: int) -> bool:
    return flags & os.O_ACCMODE != os.O_RDONLY


_take_write_kill = None


def _overtakes(op: str, args: dict) -> bool:
    """Whether a call may reach bluecached before the readers' releases waiting to be sent
    (RELEASE_DELAY_S). A writer's open may not: a new file's writer gets its memfd only
    while nobody else has the file open."""
    if op == "open":
        return not _writable(args.get("flags", 0)) and not args.get("flags", 0) & os.O_TRUNC
    return op in _OVERTAKES_RELEASES


def _write_kills(fh: int, offset: int) -> bool:
    """Whether the write to (fh, offset) being taken now carries FUSE_WRITE_KILL_SUIDGID: the
    kernel sets it when the writer lacks CAP_FSETID, and with direct_io it clears no
    set-user-ID or set-group-ID bit itself. pyfuse3 does not pass write_flags on; the fuse shim
    (native/fuse_shim.c), when in this process, read them from the request. Ask before the
    write's first await: the shim remembers only the request being processed."""
    global _take_write_kill
    if _take_write_kill is None:
        shim = sys.modules.get("hostd._fuse_shim")   # loaded by hostd before pyfuse3, or never
        if shim is None:
            return False
        _take_write_kill = getattr(shim.lib, "bc_take_write_kill", None) or (lambda fh, off: 0)
    return bool(_take_write_kill(fh, offset))


class CallInterrupted(RemoteError):
    """A request that was sent when bluecached went away (restarted, stopped, too slow): it
    may or may not have been done. EIO, as the kernel's caller must be told so."""


class NotSent(RemoteError):
    """A call's `only_while` no longer held when it could be sent (the daemon it was meant
    for restarted while it waited): not sent at all."""


class _Pool:
    """Numbered buffers to take and give back; taking waits at most `wait_limit`."""

    def __init__(self, numbers, what: str):
        self.what = what
        self._free = list(numbers)
        self._available = trio.Semaphore(len(self._free))

    def take_nowait(self) -> int:
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            return -1
        return self._free.pop()

    async def take(self, wait_limit: float | None, held: int) -> int:
        got = self.take_nowait()
        if got >= 0:
            return got
        # Every one is in use, or held for a daemon that does not answer: a request waits no
        # longer for one than it would wait for the daemon.
        with trio.move_on_after(wait_limit if wait_limit else math.inf):
            await self._available.acquire()
            return self._free.pop()
        raise RemoteError(errno.ETIMEDOUT, f"no {self.what} free within {wait_limit:g}s "
                                           f"({held} held for requests bluecached has not "
                                           "answered)")

    def give(self, number: int) -> None:
        self._free.append(number)
        self._available.release()

    def free(self) -> int:
        return len(self._free)


class Staging:
    """Fixed 1 MiB slots in one shared region (fusefs' `StagingSlots`), and after them
    `large` buffers of `large_size` bytes each, contiguous, for reads larger than a slot
    (mount.max_pages above 256): one daemon request and one reply per kernel request, no
    copy. A large buffer is numbered after the slots (slots + j) and given back with give()
    and held with hold() as a slot is.

    The large buffers start on a 2 MiB boundary and the region ends on one, so that on 2 MiB
    pages a 4 MiB buffer is two pages: an O_DIRECT read into it is two segments for the
    disk. Unaligned, the last buffer ended in 4 KiB pages past the last whole 2 MiB page
    (258 segments, over the virtio disk's 254): its reads were split in two and the
    second part waited 1.7 ms to be requeued (a kernel trace of NVMe hits, 2-core AMD EPYC
    VM)."""

    stride = SLOT_STRIDE
    head = SLOT_HEAD

    def __init__(self, slots: int, large: int = 0, large_size: int = 0, huge: bool = False):
        """`huge`: on 2 MiB pages (bluecached/huge_pages.py: NVMe hits are read into it by
        O_DIRECT)."""
        self.slots = slots
        self.large = large if large_size > SLOT_SIZE else 0
        self.large_size = large_size if self.large else 0
        self.large_start = _round_up(slots * SLOT_STRIDE, HUGE_PAGE)
        self.region = SharedRegion(
            _round_up(self.large_start + self.large * self.large_size, HUGE_PAGE),
            "bluecache-staging", huge=huge)
        self._slots = _Pool(range(slots), "staging slot")
        self._large = _Pool(range(slots, slots + self.large), "large read buffer")
        self.region_id = 0
        self.wait_limit: float | None = None   # take() gives up after this (DaemonLink sets it)
        # Slots named by requests bluecached may still serve (hold), and those of them given
        # back meanwhile: they return to the free list only once it cannot (release).
        self._holds: dict[int, int] = {}
        self._parked: set[int] = set()

    async def take(self) -> int:
        return await self._slots.take(self.wait_limit, len(self._holds))

    def take_nowait(self) -> int:
        """A free slot, or -1 when all are taken."""
        return self._slots.take_nowait()

    async def take_large(self) -> int:
        """A free large buffer, waiting as take() does."""
        return await self._large.take(self.wait_limit, len(self._holds))

    def take_large_nowait(self) -> int:
        return self._large.take_nowait()

    def free_large(self) -> int:
        return self._large.free()

    def give(self, slot: int) -> None:
        if slot in self._holds:
            self._parked.add(slot)
            return
        (self._large if slot >= self.slots else self._slots).give(slot)

    def hold(self, slots) -> None:
        """`slots` are named by a request sent to bluecached whose caller stopped waiting
        before the reply (it timed out, or the link was declared lost): a stopped or slow
        daemon may still move bytes into or out of them when it runs again. Given back, they
        are not reused until `release`."""
        for slot in slots:
            self._holds[slot] = self._holds.get(slot, 0) + 1

    def release(self, slots) -> None:
        """That request's reply came after all, or the daemon that had it is gone."""
        for slot in slots:
            left = self._holds.pop(slot, 0) - 1
            if left > 0:
                self._holds[slot] = left
            elif slot in self._parked:
                self._parked.discard(slot)
                self.give(slot)

    def free(self) -> int:
        return self._slots.free()

    def address(self) -> int:
        """Where slot 0 starts in this process; the map stays put until DaemonLink.close()."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.region.map))

    def offset(self, slot: int) -> int:
        """Where the slot's payload (or large buffer) starts in the region."""
        if slot < self.slots:
            return slot * SLOT_STRIDE + SLOT_HEAD
        return self.large_start + (slot - self.slots) * self.large_size

    def slot_at(self, offset: int) -> int | None:
        """The slot or large buffer holding region offset `offset`, if any."""
        end_of_slots = self.slots * SLOT_STRIDE
        if 0 <= offset < end_of_slots:
            return (offset - SLOT_HEAD) // SLOT_STRIDE if offset >= SLOT_HEAD else None
        if self.large and offset >= self.large_start:
            j = (offset - self.large_start) // self.large_size
            return self.slots + j if j < self.large else None
        return None

    def view(self, slot: int, length: int) -> memoryview:
        start = self.offset(slot)
        return self.region.view[start:start + length]


@dataclass(slots=True)
class StagedWrite:
    """A write answered once staged, waiting for the sender."""
    fh: int
    file: "OpenFile"
    seq: int      # in hostd/inflight.py
    slot: int
    offset: int
    length: int
    kill_suidgid: bool = False   # the writer lacks CAP_FSETID (see _write_kills)


@dataclass(slots=True)
class OpenFile:
    ino: int
    flags: int
    daemon_fh: int
    generation: int
    error: RemoteError | None = None   # a write answered early that then failed
    size_at_open: int = 0              # how far read-ahead may go (a hint: see readahead.py)
    kernel_writes: bool = False        # its kernel writes the daemon's memfd directly
    # writes answered once stored, whatever write_ack says: the kernel reads the inode's
    # memfd itself (passthrough beside this handle) and would not wait for a staged one
    ack_stored: bool = False
    # set once bluecached heard of an open answered from a kept memfd (KeptBackings):
    # daemon_fh is None until then
    confirmed: trio.Event | None = None
    late: bool = False   # no kernel's: a handle an open made after its caller gave up
    # a late one's daemon (incarnation): which of its sessions holds the handle is not known
    incarnation: str | None = None


class DaemonLink:
    def __init__(self, client: AsyncClient, regions_path: str | None, slots: int,
                 request_timeout: float, doca_settings=None, ack_staged: bool = False,
                 read_ahead: int = 4, kept: KeptBackings | None = None,
                 large_reads: int = 0, huge_staging: bool = False):
        self.client = client
        self.regions_path = regions_path
        self.doca_settings = doca_settings   # hostd.yaml's doca section
        self.exporter = None                 # HostExporter, once a daemon runs the doca engine
        self.engine = None                   # the daemon's engine, from its hello
        # the daemon refuses a file past this size; a write answered early checks it here,
        # so the writer gets EFBIG from write(2) rather than from close(2)
        self.max_file_size = 1 << 63
        self.daemon_clears_setid = False
        self.daemon_backs = False   # bluecached hands out memfds (the backing op)
        self.daemon_opens_backed = False   # ... and with a read-only open (open's `backing`)
        self.daemon_backs_writers = False  # ... and a new file's with its create (or O_TRUNC)
        self.daemon_keeps = False   # ... and takes an open answered from a kept one (`kept`)
        self.daemon_prepares = False   # ... or as its lookup prepared it (`lookup`'s `prepare`)
        self.kept = kept            # memfds kept for opens answered by hostd alone
        self._confirms_send, self._confirms = trio.open_memory_channel(float("inf"))
        # Whether the kernel can use a memfd (fusefs.Passthrough.negotiated): then read-only
        # opens ask for it at once. Set by hostd/daemon.py.
        self.wants_backing = lambda: False
        # fh: what its open brought for backing(fh), asked next: (fd, size), or None where
        # the open asked for the memfd and bluecached had none to give
        self._backings: dict[int, tuple[int, int] | None] = {}
        self._staging_export = None
        # `large_reads`: the largest read the kernel may send (mount.max_pages); above a slot,
        # LARGE_BUFFERS buffers that size serve them whole
        self.staging = Staging(slots, LARGE_BUFFERS, large_reads, huge_staging)
        self.request_timeout = request_timeout
        self.staging.wait_limit = request_timeout
        self._held_for: dict[int, list[int]] = {}   # request id -> staging slots it named
        self._staging_regions: set[int] = set()     # every id the staging region had
        self._undropped: set[int] = set()   # files to discard (_drop_file) not yet dropped
        client.on_abandoned, client.on_late = self._hold_slots, self._answered_late
        self._late_opens: set[int] = set()   # abandoned open/create requests: see _answered_late
        self.bytes_copied = 0           # payload bytes hostd itself copied (POSIX path only)
        self.generation = 0             # bumps at every (re)connection to a daemon
        self.incarnation = None
        self.session = None
        self.on_restart = lambda: None  # the mount drops kernel caches when the daemon changed
        self._channel: RegionChannel | None = None
        self._connected = trio.Event()
        self._lost = trio.Event()
        self.stopping = False   # set by hostd when it starts to unmount
        self._files: dict[int, OpenFile] = {}
        self._next_fh = 1
        # RELEASE is answered at once and forwarded by a task: close(2) returned long ago,
        # and an answer still owed when the mount goes away would be an error in the log.
        self._releases_send, self._releases = trio.open_memory_channel(float("inf"))
        self._releases_queued = 0       # releases given to forward_releases, ever
        self._releases_forwarded = 0    # ... and forwarded (answered or given up), in order
        self._release_forwarded = trio.Event()   # set (and replaced) at each
        self._release_now = trio.Event()   # a call that must not overtake them came
        self.ack_staged = ack_staged
        self.inflight = WritesInFlight()
        self.read_ahead = ReadAhead(self.staging, self._read_into, SLOT_SIZE, read_ahead) \
            if read_ahead else None
        self._writes: trio.Nursery | None = None   # background write calls (send_writes)
        self._unsent: list[StagedWrite] = []
        self._staged = trio.Event()   # set when _unsent gains a write

    # -- connection ------------------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> None:
        """First connection; raises if the daemon does not answer within `timeout`."""
        with trio.fail_after(timeout or self.request_timeout):
            while True:
                try:
                    await self._establish()
                    return
                except (RemoteError, OSError) as e:
                    log.debug("bluecached not there yet: %s", e)
                    await trio.sleep(0.2)

    async def _establish(self) -> None:
        hello = await self.client.handshake(timeout=2, replaces=self.session)
        self.engine = hello["engine"]
        self.max_file_size = hello.get("max_file_size", self.max_file_size)
        # an optional argument an older daemon would refuse ("unknown argument") on every
        # write by a non-root user: sent only to a daemon that says it knows it
        self.daemon_clears_setid = "kill_suidgid" in hello.get("features", ())
        self.daemon_backs = "backing" in hello.get("features", ())
        self.daemon_opens_backed = "open_backing" in hello.get("features", ())
        self.daemon_backs_writers = "writer_backing" in hello.get("features", ())
        self.daemon_keeps = "open_kept" in hello.get("features", ())
        self.daemon_prepares = "open_prepared" in hello.get("features", ())
        self.daemon_xattrs = "xattrs" in hello.get("features", ())
        if self.engine == "doca":
            await self._import_staging()
        elif self.regions_path is not None:
            channel = await trio.to_thread.run_sync(RegionChannel, self.regions_path,
                                                    self.request_timeout)
            try:
                region_id = await trio.to_thread.run_sync(channel.register, self.staging.region)
            except BaseException:
                channel.close()
                raise
            if self._channel is not None:
                self._channel.close()
            self._channel, self.staging.region_id = channel, region_id
        restarted = self.incarnation is not None and hello["incarnation"] != self.incarnation
        if restarted:   # the daemon that had unanswered requests is gone with them
            for rid in list(self._held_for):
                self._release_slots(rid)
            self._late_opens.clear()
        self._staging_regions.add(self.staging.region_id)
        for ino in sorted(self._undropped):   # before any other request of this session
            await self.client.call("discard", timeout=2, ino=ino)
            self._undropped.discard(ino)
            log.info("dropped inode %d, whose write failed while bluecached was away", ino)
        self.incarnation, self.session = hello["incarnation"], hello["session"]
        self.generation += 1
        if self.kept is not None:   # the old daemon's memfds: not this one's objects
            self.kept.clear()
        self._lost = trio.Event()
        self._connected.set()
        log.info("connected to %s (engine %s, session %d)%s", hello["server"], hello["engine"],
                 hello["session"], "; it restarted" if restarted else "")
        if restarted:
            self.on_restart()

    def doca_exporter(self):
        """The DOCA exporter (opened on first need: only a doca daemon asks for one)."""
        if self.exporter is None:
            settings = self.doca_settings
            if settings is None:
                raise RemoteError(errno.EOPNOTSUPP, "bluecached runs the doca engine but hostd "
                                                    "has no doca settings")
            try:
                self.exporter = HostExporter(settings.library, settings.pci_address)
            except OSError as e:
                raise DocaSetupError(f"bluecached runs the doca engine, but hostd cannot export "
                                     f"memory with DOCA: {e.strerror or e}") from None
        return self.exporter

    async def _import_staging(self) -> None:
        """Staging exported once per process; imported again after every (re)connection."""
        if self._staging_export is None:
            region = self.staging.region
            self._staging_export = self.doca_exporter().export(
                ctypes.addressof(ctypes.c_char.from_buffer(region.map)), region.length,
                writable=True)
        export = self._staging_export
        r = await self.client.call("import_region", timeout=5, descriptor=export.descriptor,
                                   address=export.address, length=export.length)
        self.staging.region_id = r["region"]

    def _hold_slots(self, rid: int, op: str, args: dict) -> None:
        """The client's on_abandoned: request `rid` was sent and its caller stopped waiting.
        The staging slots it names stay out of use until it is answered (Staging.hold)."""
        if op in ("open", "create"):
            self._late_opens.add(rid)
        if args.get("region") not in self._staging_regions:
            return   # not staging: a zero-copy transfer names the caller's own memory
        offsets = args.get("region_offsets") or [args.get("region_offset")]
        slots = [self.staging.slot_at(o) for o in offsets if isinstance(o, int)]
        slots = [slot for slot in slots if slot is not None]
        if slots:
            self._held_for[rid] = slots
            self.staging.hold(slots)

    def _answered_late(self, rid: int, reply: dict | None) -> None:
        """The client's on_late: `rid` was answered after all (`reply`), or can no longer be
        (None). An open or create whose caller had its EIO but which bluecached did after
        all left a handle there that no kernel will release: it is released here (unless
        the reconnect that followed the timeout released it with the old session)."""
        self._release_slots(rid)
        if rid in self._late_opens:
            self._late_opens.discard(rid)
            result = reply.get("result") if reply is not None and reply.get("ok") else None
            if isinstance(result, dict) and isinstance(result.get("fh"), int):
                self._queue_release(OpenFile(0, 0, result["fh"], self.generation, late=True,
                                             incarnation=self.incarnation))

    def _release_slots(self, rid: int) -> None:
        slots = self._held_for.pop(rid, None)
        if slots:
            self.staging.release(slots)

    def _mark_lost(self, why: str) -> None:
        if self._connected.is_set():
            # while hostd unmounts, its last requests may meet a daemon stopping with it
            # (bluecachectl up, systemctl stop of both): expected, not a warning
            log.log(logging.INFO if self.stopping else logging.WARNING,
                    "lost bluecached (%s); requests wait up to %gs", why, self.request_timeout)
            self._connected = trio.Event()
            self._lost.set()
            self.client.fail_pending(errno.ECONNRESET, f"bluecached went away: {why}")

    async def watch(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Health task: ping; on failure reconnect until it works."""
        task_status.started()
        while True:
            if self.kept is not None:
                self.kept.expire()
            if self._connected.is_set():
                with trio.move_on_after(PING_INTERVAL):
                    await self._lost.wait()
                if self._connected.is_set():
                    try:
                        await self.client.call("ping", timeout=PING_INTERVAL * 2)
                    except RemoteError as e:
                        self._mark_lost(str(e))
                continue
            try:
                await self._establish()
            except (RemoteError, OSError) as e:
                log.debug("reconnect failed: %s", e)
                await trio.sleep(0.2)

    async def call(self, op: str, host_fh: int | None = None, host_fhs: list | None = None,
                   with_fd: bool = False, only_while=None, **args):
        """A request, waiting out a daemon restart for those safe to repeat. With `host_fh`
        (`host_fhs`), the daemon's handle (`fhs`) is looked up at each attempt (a restart
        re-opens it); so is the staging region's id with `region=STAGING`. With `only_while`
        (a callable), each attempt is sent only if it still returns true (else NotSent): a
        call that names a daemon handle itself must not reach a daemon that restarted
        meanwhile, whose numbers are other handles. It fails within `request_timeout`: a call
        made inside another (the re-open of a handle) shares the outer one's deadline."""
        deadline = trio.current_time() + self.request_timeout
        outer = _CALL_DEADLINE.get()
        if outer is not None and outer < deadline:
            deadline = outer
        if self._releases_forwarded < self._releases_queued and not _overtakes(op, args):
            with trio.move_on_at(deadline):   # past it, the call fails as any would
                await self._releases_sent(self._releases_queued)
        token = _CALL_DEADLINE.set(deadline)
        try:
            return await self._call_by(deadline, op, host_fh, host_fhs, with_fd, only_while,
                                       **args)
        finally:
            _CALL_DEADLINE.reset(token)

    async def _call_by(self, deadline: float, op: str, host_fh: int | None,
                       host_fhs: list | None, with_fd: bool, only_while, **args):
        staging = args.get("region") is STAGING
        while True:
            if only_while is not None and not only_while():
                raise NotSent(errno.EBADF, f"{op}: not sent, what it names went with the "
                                           "bluecached it was meant for")
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise RemoteError(errno.ETIMEDOUT, f"{op}: bluecached unavailable for "
                                                   f"{self.request_timeout:g}s")
            if not self._connected.is_set():
                with trio.move_on_after(remaining):
                    await self._connected.wait()
                continue
            attempt = self.generation
            try:
                if host_fh is not None:
                    args["fh"] = await self.daemon_fh(host_fh)
                if host_fhs is not None:
                    args["fhs"] = [await self.daemon_fh(fh) for fh in host_fhs]
                attempt = self.generation   # (a re-open above may have waited out a reconnect)
                if staging:
                    args["region"] = self.staging.region_id
                if with_fd:   # (result, fd or None)
                    return await self.client.call_with_fd(op, timeout=max(remaining, 0.001),
                                                          **args)
                return await self.client.call(op, timeout=max(remaining, 0.001), **args)
            except RemoteError as e:
                if e.errno == errno.ECONNREFUSED:
                    # Not sent (the daemon's socket is gone): safe to send again, whatever the
                    # op, once it is back; until the deadline, as any request waits.
                    self._mark_lost(str(e))
                    continue
                if e.errno == errno.EPROTO and "hello" in str(e):
                    self._mark_lost("it restarted")
                elif e.errno == errno.ETIMEDOUT:
                    self._mark_lost(str(e))
                elif e.errno == errno.ECONNRESET:
                    # The connection closed under the request (the daemon stopped). Unless a
                    # reconnect came since, the link must say hello again first, and the
                    # retry wait for that: sent again at once it meets the same closed
                    # socket, and a loop that never awaits starves the tasks that would
                    # notice (the transport's reader, the health task) until the deadline.
                    if self.generation == attempt:
                        self._mark_lost(str(e))
                else:
                    raise
                if op not in _IDEMPOTENT:
                    raise CallInterrupted(errno.EIO, f"{op} interrupted by a bluecached "
                                                     "restart (it may or may not have "
                                                     "happened)") from None

    # -- handles ---------------------------------------------------------------------------

    def _add_file(self, ino: int, flags: int, daemon_fh: int, size: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        if self.read_ahead is not None:
            self.read_ahead.opened(ino, _writable(flags))
        # Re-opening after a restart must not truncate or create again.
        self._files[fh] = OpenFile(ino, flags & ~(os.O_TRUNC | os.O_CREAT | os.O_EXCL),
                                   daemon_fh, self.generation, size_at_open=size)
        return fh

    def open_file(self, fh: int) -> OpenFile | None:
        return self._files.get(fh)

    def answer_writes_stored(self, fh: int) -> None:
        """The kernel reads this handle's inode from the memfd itself (passthrough): its
        writes are answered once bluecached has them, as with write_ack: stored. A reader
        there never waits for a write answered once staged (found by a probe: a write(2)
        through this handle, then a read by passthrough, read the bytes from before)."""
        f = self._files.get(fh)
        if f is not None:
            f.ack_stored = True

    async def daemon_fh(self, fh: int) -> int:
        f = self._files.get(fh)
        if f is None:
            raise RemoteError(errno.EBADF, f"no open file {fh}")
        if f.confirmed is not None:
            await f.confirmed.wait()
        if f.generation != self.generation and f.kernel_writes:
            # Its kernel wrote the old daemon's memfd, which the new one never had.
            raise RemoteError(errno.EIO, f"bluecached restarted while inode {f.ino} was being "
                                         "written: its bytes are lost, write it again")
        if f.generation != self.generation:  # the daemon restarted since the open
            try:
                r = await self.call("open", ino=f.ino, flags=f.flags)
            except RemoteError as e:
                if e.errno not in (errno.ESTALE, errno.ENOENT):   # ENOENT: an older daemon
                    raise
                # The new daemon has no such inode: it had no name left when the old one
                # stopped (unlinked or replaced while open), or was evicted or unfinished.
                # ESTALE, as NFS answers for a handle whose file is gone: a reader's ENOENT
                # (FileNotFoundError) would read as "no such block", not "your open is void".
                log.info("inode %d: open before bluecached restarted, gone since: ESTALE",
                         f.ino)
                raise RemoteError(errno.ESTALE, f"inode {f.ino} is gone since bluecached "
                                                "restarted (open again by name)") from None
            f.daemon_fh, f.generation = r["fh"], self.generation
        return f.daemon_fh

    # -- the fusefs Cache interface --------------------------------------------------------

    async def lookup(self, parent, name) -> Attr:
        # With `prepare`, the open that follows may be answered here (hostd/kept_backings.py).
        prepare = self._answers_opens(self.daemon_prepares)
        stamp = self.kept.stamp() if prepare else 0
        extra = {"prepare": True} if prepare else {}   # (a daemon without it refuses it)
        r = await self.call("lookup", parent=parent, name=name, **extra)
        attr = Attr.from_wire(r)
        if self.inflight.pending(attr.ino):   # its size may not count writes answered early
            return await self.getattr(attr.ino)
        if "prepared" in r:
            self.kept.prepare(attr.ino, r["prepared"], attr, self.generation, stamp)
        return attr

    def _answers_opens(self, daemon_can: bool) -> bool:
        """Whether read-only opens may be answered here (kept memfds, prepared opens): the
        daemon takes them (`daemon_can`), they are not turned off (mount.kept_opens 0) and
        the kernel can read a memfd itself (passthrough: the open may have to name the
        inode's backing id, fusefs/passthrough.py)."""
        return self.kept is not None and daemon_can and self.wants_backing()

    async def getattr(self, ino) -> Attr:
        await self.inflight.settled(ino)
        return Attr.from_wire(await self.call("getattr", ino=ino))

    async def setattr(self, ino, **changes) -> Attr:
        await self.inflight.settled(ino)
        if self.kept is not None:
            self.kept.changing(ino)
        if self.read_ahead is None:
            return Attr.from_wire(await self.call("setattr", ino=ino, **changes))
        self.read_ahead.changing(ino)
        try:
            return Attr.from_wire(await self.call("setattr", ino=ino, **changes))
        finally:
            self.read_ahead.changing(ino)

    async def mkdir(self, parent, name, mode, uid, gid) -> Attr:
        return Attr.from_wire(await self.call("mkdir", parent=parent, name=name, mode=mode,
                                              uid=uid, gid=gid))

    async def symlink(self, parent, name, target, uid, gid) -> Attr:
        return Attr.from_wire(await self.call("symlink", parent=parent, name=name,
                                              target=target, uid=uid, gid=gid))

    async def mknod(self, parent, name, mode, rdev, uid, gid) -> Attr:
        return Attr.from_wire(await self.call("mknod", parent=parent, name=name, mode=mode,
                                              rdev=rdev, uid=uid, gid=gid))

    async def link(self, ino, new_parent, new_name) -> Attr:
        await self.inflight.settled(ino)   # the reply carries its size
        return Attr.from_wire(await self.call("link", ino=ino, new_parent=new_parent,
                                              new_name=new_name))

    async def readlink(self, ino) -> bytes:
        return (await self.call("readlink", ino=ino))["target"]

    async def create(self, parent, name, mode, uid, gid, flags):
        args = dict(parent=parent, name=name, mode=mode, uid=uid, gid=gid, flags=flags)
        fd = None
        if self.daemon_backs_writers and _writable(flags) and self.wants_backing():
            r, fd = await self.call("create", **args, backing=True, with_fd=True)
        else:
            r = await self.call("create", **args)
        attr = Attr.from_wire(r["attr"])
        return self._opened(attr, flags, r, fd), attr

    async def open(self, ino, flags):
        await self.inflight.settled(ino)
        reading = flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC
        if self.kept is not None and not reading:
            self.kept.changing(ino)
        elif self._answers_opens(self.daemon_keeps or self.daemon_prepares):
            answered = self._answer_prepared(ino, flags) or self._answer_kept(ino, flags)
            if answered is not None:
                return answered
        stamp = self.kept.stamp() if self.kept is not None else 0
        fd = None
        if self._backed_open(flags) and self.wants_backing():
            r, fd = await self.call("open", ino=ino, flags=flags, backing=True, with_fd=True)
        else:
            r = await self.call("open", ino=ino, flags=flags)
        attr = Attr.from_wire(r["attr"])
        fh = self._opened(attr, flags, r, fd)
        if (fd is not None and reading and self.kept is not None and self.daemon_keeps
                and r.get("backing_keep", True)):   # False: a clone of the NVMe extent
            self.kept.keep(ino, fd, r["backing_size"], attr, self.generation, stamp)
        return fh, attr

    def _answer_kept(self, ino: int, flags: int) -> tuple[int, Attr] | None:
        """A read-only open answered from the memfd kept for `ino`, bluecached told after
        (confirm_opens_answered_here); None if none is kept."""
        if not self.daemon_keeps:
            return None
        got = self.kept.take(ino, self.generation)
        if got is None:
            return None
        fd, entry = got
        return self._answered_here(ino, flags, entry.size, (fd, entry.size), entry.attr,
                                   {"kept": entry.identity})

    def _answer_prepared(self, ino: int, flags: int) -> tuple[int, Attr] | None:
        """A read-only open answered as its lookup prepared: nothing to lend, its reads go
        through bluecached; None if nothing was prepared for it."""
        if not self.daemon_prepares:
            return None
        entry = self.kept.take_prepared(ino, flags, self.generation)
        if entry is None:
            return None
        return self._answered_here(ino, flags, entry.attr.size, None, entry.attr, {})

    def _answered_here(self, ino: int, flags: int, size: int, brought: tuple[int, int] | None,
                       attr: Attr, confirm: dict) -> tuple[int, Attr]:
        fh = self._add_file(ino, flags, None, size)
        self._files[fh].confirmed = trio.Event()
        self._backings[fh] = brought   # for backing(fh), asked next
        self._confirms_send.send_nowait((self._files[fh], confirm))
        return fh, attr

    async def confirm_opens_answered_here(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sends bluecached each open answered here, once its kernel had the answer:
        bluecached counts it as any open and, for a kept memfd, says whether it is still the
        file's."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for f, confirm in self._confirms:
                nursery.start_soon(self._confirm_answered, f, confirm)

    async def _confirm_answered(self, f: OpenFile, confirm: dict) -> None:
        try:
            r = await self.call("open", ino=f.ino, flags=f.flags, **confirm)
        except RemoteError as e:
            # No handle at bluecached (the file went, or bluecached is away): a call that
            # needs one opens it then (daemon_fh); its reader has the bytes it was given.
            f.generation = -1
            self.kept.drop(f.ino)
            log.debug("open of inode %d answered here not confirmed: %s", f.ino, e)
        else:
            f.daemon_fh, f.generation = r["fh"], self.generation
            if "kept" in confirm and not r.get("kept"):
                self.kept.refused_by_daemon(f.ino, confirm["kept"])
        finally:
            f.confirmed.set()

    def _backed_open(self, flags: int) -> bool:
        """Whether an open asks for the memfd with it: a reader's, or a truncating writer's
        (then a new file's, as a create's)."""
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC:
            return self.daemon_opens_backed
        return bool(flags & os.O_TRUNC) and self.daemon_backs_writers

    def _opened(self, attr: Attr, flags: int, r: dict, fd: int | None) -> int:
        fh = self._add_file(attr.ino, flags, r["fh"], attr.size)
        if fd is not None:
            self._backings[fh] = (fd, r["backing_size"])   # for backing(fh), asked next
            self._files[fh].kernel_writes = _writable(flags)
        elif self._backed_open(flags) and self.wants_backing():
            self._backings[fh] = None
        return fh

    async def backing(self, fh) -> tuple[int, int] | None:
        """(fd, size) of the memfd holding open file `fh`'s bytes, for the kernel to read it
        itself (fusefs/passthrough.py); the caller closes fd. None where bluecached has none
        to give: ENODATA (not complete, not in DRAM, open for writing, or DPU mode, whose
        client carries no fds) or a daemon without the op."""
        if fh in self._backings:
            # what the open brought; None: it asked a moment ago and bluecached had none (an
            # object only on NVMe, whose reads go through hostd): asking again costs a round
            # trip for the same answer
            return self._backings.pop(fh)
        f = self._files.get(fh)
        if not self.daemon_backs or f is None or _writable(f.flags):
            return None   # a writer's memfd comes with its open, or not at all
        try:
            return await self.client.backing(await self.daemon_fh(fh),
                                             timeout=self.request_timeout)
        except RemoteError as e:
            if e.errno == errno.ENODATA:
                return None
            raise

    async def read(self, fh, offset, size):
        f = self._files.get(fh)
        if f is not None:
            await self.inflight.settled(f.ino)
        if SLOT_SIZE < size <= self.staging.large_size:
            return await self._read_large(fh, f, offset, size)
        ahead = self.read_ahead if f is not None and size <= SLOT_SIZE else None
        if ahead is not None:
            ready = await ahead.take(fh, offset, size, self.generation)
            if ready is not None:
                slot, n = ready
                try:
                    if n == size == SLOT_SIZE:
                        ahead.start(fh, f.ino, offset + n, f.size_at_open, self.generation)
                    return self._answer_from(slot, min(n, size))
                finally:
                    self.staging.give(slot)
        out = bytearray() if size > SLOT_SIZE else None
        if ahead is not None and size == SLOT_SIZE:
            # beside this read, not after it: the disk (an NVMe hit) starts on what follows
            # while this piece is still on its way, as it would for a plain file's read
            ahead.start(fh, f.ino, offset + size, f.size_at_open, self.generation)
        while True:
            piece = min(size, SLOT_SIZE)
            slot = await self.staging.take()
            try:
                n = await self._read_into(fh, offset, slot, piece)
                if out is None:
                    if ahead is not None and n == SLOT_SIZE:
                        ahead.start(fh, f.ino, offset + n, f.size_at_open, self.generation)
                    return self._answer_from(slot, n)
                view = self.staging.view(slot, n)
                out += view
                self.bytes_copied += n
            finally:
                self.staging.give(slot)
            offset += n
            size -= n
            if n < piece or size == 0:
                return bytes(out)

    async def _read_large(self, fh, f: OpenFile | None, offset: int, size: int):
        """A read larger than a slot, whole into a large buffer: one daemon request, answered
        from the buffer (as a slot's read), read ahead by the request's size."""
        ahead = self.read_ahead if f is not None else None
        ready = None
        if ahead is not None:
            ready = await ahead.take(fh, offset, size, self.generation)
        if ready is not None:
            buffer, n = ready
        else:
            if ahead is not None:   # beside this read (read())
                ahead.start(fh, f.ino, offset + size, f.size_at_open, self.generation, size)
            buffer = await self.staging.take_large()
            try:
                n = await self._read_into(fh, offset, buffer, size)
            except BaseException:
                self.staging.give(buffer)
                raise
        try:
            if ahead is not None and n == size:
                ahead.start(fh, f.ino, offset + n, f.size_at_open, self.generation, size)
            return self._answer_from(buffer, min(n, size))
        finally:
            self.staging.give(buffer)

    async def _read_into(self, fh, offset: int, slot: int, length: int = SLOT_SIZE) -> int:
        return (await self.call("read", host_fh=fh, offset=offset, length=length,
                                region=STAGING,
                                region_offset=self.staging.offset(slot)))["length"]

    def _answer_from(self, slot: int, n: int):
        """A read's answer from a slot the caller gives back on return: the kernel copies it
        out before any other task can take the slot (pyfuse3 replies as soon as the handler
        returns)."""
        view = self.staging.view(slot, n)
        if _READ_TAKES_BUFFER:
            return view
        self.bytes_copied += n
        return bytes(view)

    async def write(self, fh, offset, data) -> int:
        kill = _write_kills(fh, offset)
        data = memoryview(data)
        f = self._files.get(fh)
        staged = self.ack_staged and f is not None and not f.ack_stored
        if staged and f.error is not None:
            raise RemoteError(f.error.errno, str(f.error))
        if staged and offset + len(data) > self.max_file_size:
            raise self._too_large(offset + len(data))
        done = 0
        while done < len(data):
            piece = data[done:done + SLOT_SIZE]
            start = offset + done
            slot = await self.staging.take()   # staged: also the bound on writes in flight
            try:
                self.staging.view(slot, len(piece))[:] = piece
                self.bytes_copied += len(piece)
                if staged:
                    self._stage(fh, f, slot, start, len(piece), kill)
                    slot = None   # the sender gives it back
                else:
                    await self._write_slot(fh, slot, start, len(piece), kill)
            finally:
                if slot is not None:
                    self.staging.give(slot)
            done += len(piece)
            kill = False   # the first piece cleared the bits
        return done

    def write_in_slot(self, fh: int, offset: int, slot: int, length: int, answer) -> None:
        """A write the kernel read straight into staging `slot` (fusefs/inplace.py). Called
        inside pyfuse3's request loop, so it never waits: `answer(None or an OSError)` replies
        to the kernel, at once with write_ack staged, after the daemon call otherwise."""
        kill = _write_kills(fh, offset)
        f = self._files.get(fh)
        if f is None:
            self.staging.give(slot)
            answer(RemoteError(errno.EBADF, f"no open file {fh}"))
        elif not self.ack_staged or f.ack_stored:
            self._writes.start_soon(self._write_then_answer, fh, slot, offset, length, answer,
                                    kill)
        elif f.error is not None:
            self.staging.give(slot)
            answer(f.error)
        elif offset + length > self.max_file_size:
            self.staging.give(slot)
            answer(self._too_large(offset + length))
        else:
            self._stage(fh, f, slot, offset, length, kill)
            answer(None)

    def _too_large(self, size: int) -> RemoteError:
        return RemoteError(errno.EFBIG, f"a file here holds at most {self.max_file_size} bytes "
                                        f"(bluecached's NVMe segment size): {size} asked")

    async def _write_then_answer(self, fh, slot: int, offset: int, length: int, answer,
                                 kill: bool) -> None:
        try:
            await self._write_slot(fh, slot, offset, length, kill)
        except RemoteError as e:
            answer(e)
        else:
            answer(None)
        finally:
            self.staging.give(slot)

    async def _write_slot(self, fh, slot: int, offset: int, length: int, kill: bool) -> None:
        await self.call("write", host_fh=fh, offset=offset, length=length,
                        region=STAGING, region_offset=self.staging.offset(slot),
                        **({"kill_suidgid": True} if kill and self.daemon_clears_setid else {}))

    async def send_writes(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Runs the daemon calls of writes: those answered once staged by one sender task,
        those answered once stored (write_ack: stored) each in a task of its own."""
        async with trio.open_nursery() as nursery:
            self._writes = nursery
            if self.read_ahead is not None:
                self.read_ahead.nursery = nursery
            nursery.start_soon(self._send_staged)
            task_status.started()
            await trio.sleep_forever()

    def _stage(self, fh: int, f: OpenFile, slot: int, offset: int, length: int,
               kill: bool) -> None:
        """Queues a write answered once staged for the sender."""
        seq = self.inflight.add(f.ino)
        self._unsent.append(StagedWrite(fh, f, seq, slot, offset, length, kill))
        self._staged.set()

    async def _send_staged(self) -> None:
        """Sends staged writes in the order they were answered, one message at a time, each
        with all that arrived while the one before was out (up to MAX_BATCH). Each message
        costs both daemons far more than a piece in it; and writes sent in order need no
        ordering of overlapping ones."""
        while True:
            await self._staged.wait()
            self._staged = trio.Event()
            while self._unsent:
                batch, self._unsent = self._unsent[:MAX_BATCH], self._unsent[MAX_BATCH:]
                await self._send_batch(batch)

    async def _send_batch(self, batch: list[StagedWrite]) -> None:
        live = [w for w in batch if w.file.error is None]   # a dropped file's are not sent
        failed: dict[int, RemoteError] = {}
        kills = [i for i, w in enumerate(live) if w.kill_suidgid] \
            if self.daemon_clears_setid else []
        try:
            if live:
                r = await self.call("write_batch", host_fhs=[w.fh for w in live],
                                    region=STAGING,
                                    offsets=[w.offset for w in live],
                                    lengths=[w.length for w in live],
                                    region_offsets=[self.staging.offset(w.slot) for w in live],
                                    **({"kill_suidgid": kills} if kills else {}))
                failed = {i: RemoteError(err, message) for i, err, message in r["failed"]}
        except RemoteError as e:
            failed = dict.fromkeys(range(len(live)), e)
        try:
            for i, e in failed.items():
                await self._drop_file(live[i].file, e)
        finally:   # after the drop: whatever waits for these writes then sees the file gone
            for w in batch:
                self.staging.give(w.slot)
                self.inflight.done(w.file.ino, w.seq)

    async def _drop_file(self, f: OpenFile, e: RemoteError) -> None:
        """A write to `f` failed after it was answered: the file is dropped, once."""
        if f.error is not None:
            return
        f.error = e
        log.warning("write to inode %d failed after it was answered (%s): the file is "
                    "dropped, its close reports the error", f.ino, e)
        if not self._connected.is_set():   # sent first thing once it is back (_establish)
            self._undropped.add(f.ino)
            return
        try:
            await self.call("discard", ino=f.ino)
        except RemoteError as e2:
            # A stopped daemon still has the file, and may serve a rename of it when it runs
            # again: sent again first thing on reconnection (a restarted one, harmlessly).
            log.info("could not drop inode %d yet: %s", f.ino, e2)
            self._undropped.add(f.ino)

    async def flush(self, fh) -> None:
        f = self._files.get(fh)
        if f is not None:
            await self.inflight.settled(f.ino)
            if f.error is not None:
                raise RemoteError(f.error.errno, str(f.error))
        await self.call("flush", host_fh=fh)

    async def fsync(self, fh) -> None:
        f = self._files.get(fh)
        if f is not None:
            await self.inflight.settled(f.ino)
            if f.error is not None:
                raise RemoteError(f.error.errno, str(f.error))
        await self.call("fsync", host_fh=fh)

    async def release(self, fh) -> None:
        brought = self._backings.pop(fh, None)
        if brought is not None:   # the open brought one nobody took
            os.close(brought[0])
        f = self._files.get(fh)
        if f is not None:
            await self.inflight.settled(f.ino)   # their calls name this handle
            del self._files[fh]
            if self.read_ahead is not None:
                self.read_ahead.closed(fh, f.ino, _writable(f.flags))
            self._queue_release(f)

    def _queue_release(self, f: OpenFile) -> None:
        self._releases_queued += 1
        self._releases_send.send_nowait((f, trio.current_time()))

    async def forward_releases(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for f, closed_at in self._releases:
            try:
                # A reader's, after the calls that follow it. Not an abandoned open's: its
                # handle may be of a session a reconnect is about to replace.
                if not _writable(f.flags) and not f.late:
                    with trio.move_on_at(closed_at + RELEASE_DELAY_S):
                        await self._release_now.wait()
                await self._forward_release(f)
            finally:
                self._releases_forwarded += 1
                if self._releases_forwarded == self._releases_queued:
                    self._release_now = trio.Event()
                forwarded, self._release_forwarded = self._release_forwarded, trio.Event()
                forwarded.set()

    async def _releases_sent(self, count: int) -> None:
        """Until the first `count` releases were forwarded, those waiting sent at once."""
        self._release_now.set()
        while self._releases_forwarded < count:
            await self._release_forwarded.wait()

    def _handle_still_there(self, f: OpenFile) -> bool:
        if f.late:
            # The reply may have been read before the reconnect's hello reply was handled,
            # yet come from the new session (the daemon served the hello first): released
            # whatever the generation, unless the daemon is another one (its fh numbers
            # start again). A handle the old session held is gone with it: EBADF, below.
            return f.incarnation == self.incarnation
        # else the daemon restarted or the session was replaced: the handle is gone
        return f.generation == self.generation

    async def _forward_release(self, f: OpenFile) -> None:
        if f.confirmed is not None:
            await f.confirmed.wait()
        try:
            # checked again when it is sent: a release that waited out a reconnect would
            # otherwise close whichever handle a restarted daemon now numbers so
            await self.call("release", fh=f.daemon_fh,
                            only_while=lambda: self._handle_still_there(f))
        except NotSent:
            return
        except CallInterrupted:
            # Done or not, the handle goes with its session: bluecached releases a
            # session's handles when it ends (disconnected, replaced by the reconnect
            # that follows, or the daemon stopping), as when `up` stops both at once.
            log.debug("release of inode %d went with its session", f.ino)
        except RemoteError as e:
            if f.late and e.errno == errno.EBADF:
                return   # its session was replaced, and the handle released with it
            log.warning("release of inode %d not delivered: %s", f.ino, e)

    async def unlink(self, parent, name) -> None:
        await self.call("unlink", parent=parent, name=name)

    async def rmdir(self, parent, name) -> None:
        await self.call("rmdir", parent=parent, name=name)

    async def rename(self, parent, name, new_parent, new_name, flags) -> None:
        # llm-d renames its file while it is still open: the new name must not show it
        # before every write answered earlier has landed (or failed and dropped the file)
        await self.inflight.earlier_done()
        await self.call("rename", parent=parent, name=name, new_parent=new_parent,
                        new_name=new_name, flags=flags)

    async def readdir(self, ino, offset, limit):
        await self.inflight.earlier_done()   # entries carry sizes
        r = await self.call("readdir", ino=ino, offset=offset, limit=limit)
        return r.get("parent", ino), [(name, Attr.from_wire(attr), cookie)
                                      for name, attr, cookie in r["entries"]]

    async def statfs(self) -> dict:
        return await self.call("statfs")

    # -- extended attributes (a daemon without them: EOPNOTSUPP, as before they existed) ---

    def _xattrs_supported(self) -> None:
        if not getattr(self, "daemon_xattrs", False):
            raise RemoteError(errno.EOPNOTSUPP, "bluecached does not keep extended attributes")

    async def setxattr(self, ino, name, value, flags=0) -> None:
        self._xattrs_supported()
        args = {"flags": flags} if flags else {}
        await self.call("setxattr", ino=ino, name=name, value=bytes(value), **args)

    async def getxattr(self, ino, name) -> bytes:
        self._xattrs_supported()
        return (await self.call("getxattr", ino=ino, name=name))["value"]

    async def listxattr(self, ino) -> list[bytes]:
        self._xattrs_supported()
        names = (await self.call("listxattr", ino=ino))["names"]
        return names.split(b"\0")[:-1]

    async def removexattr(self, ino, name) -> None:
        self._xattrs_supported()
        await self.call("removexattr", ino=ino, name=name)

    async def forget(self, counts) -> None:
        for start in range(0, len(counts), 4096):
            batch = counts[start:start + 4096]
            await self.call("forget", inos=[i for i, _ in batch], counts=[n for _, n in batch])

    def close(self) -> None:
        if self.kept is not None:
            self.kept.clear()
        if self._channel is not None:
            self._channel.close()
        if self._staging_export is not None:
            self.exporter.unexport(self._staging_export)
        if self.exporter is not None:
            self.exporter.close()
        self.staging.region.close()
