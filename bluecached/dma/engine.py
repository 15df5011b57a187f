"""The DMA engine interface.

A region is client memory the engine can reach (loopback: a shared memfd; DOCA: a host export
imported on the DPU). The store hands the engine lists of its own buffers; the engine moves the
bytes between those and a region, and nothing else touches them.
"""

import errno
import itertools
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence

import trio


class EngineUnavailable(Exception):
    """The configured engine cannot start here (no device, no library): an operator's problem,
    reported in one line."""


class DmaError(OSError):
    """Carries the errno a client gets for a bad region or a failed transfer."""

    def __init__(self, err: int, message: str):
        super().__init__(err, message)


class Region:
    __slots__ = ("id", "length", "kind", "owner", "refs", "closed", "__weakref__", "handle")

    def __init__(self, length: int, kind: str, handle, owner=None):
        self.id = 0
        self.length = length
        self.kind = kind
        self.owner = owner
        self.handle = handle   # engine-specific: loopback keeps the mapping here
        self.refs = 0          # transfers in flight
        self.closed = False

    def check_span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise DmaError(errno.EFAULT, f"span {offset}+{length} is outside region {self.id} "
                                         f"of {self.length} bytes")


class DmaEngine(ABC):
    name: str

    def describe(self) -> str:
        """One line for logs and `bluecachectl status`: what moves the bytes."""
        return self.name

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The engine's service task, if it needs one (started before any transfer)."""
        task_status.started()

    def forget_host_memory(self, buffer) -> None:
        """The store is about to unmap `buffer` (a DRAM chunk): drop any registration the
        engine made on it. Most engines register none."""
        return

    @abstractmethod
    def register(self, source, owner=None) -> Region:
        """Makes client memory reachable. `source` is engine-specific."""

    @abstractmethod
    def release(self, region: Region) -> None:
        """Frees what register took; called once no transfer uses the region."""

    @abstractmethod
    async def to_store(self, region: Region, offset: int, dst: Sequence[memoryview]) -> None:
        """Region bytes [offset, offset + sum(len(dst))) into the store buffers `dst`."""

    async def to_new_file(self, region: Region, offset: int, fd: int, length: int) -> bool:
        """Region bytes [offset, offset + length) as the start of `fd`, a memfd of the store
        nothing has touched yet (a STORE's new content), written by this process's kernel
        where the engine can; False where it cannot, and the caller copies into the
        content's chunks (to_store)."""
        return False

    def wants_allocated(self, region: Region) -> bool:
        """Whether store memory a copy from or to `region` touches should have its pages
        before the copy (the caller allocates them, 2 MiB ones where the shmem policy
        allows): memory a device reaches must be page-locked, and locking pages that are
        not there yet faults them in one 4 KiB page at a time."""
        return False

    @abstractmethod
    async def from_store(self, src: Sequence[memoryview], region: Region, offset: int) -> None:
        """Store buffers `src` into the region starting at `offset`."""

    def host_view(self, region: Region, offset: int, length: int) -> memoryview | None:
        """The region's bytes [offset, offset + length) as writable memory of this process,
        where the engine maps it so (a tier may then read from disk straight into it); None
        where it does not (DMA to another machine's memory, a GPU)."""
        return None


class RegionTable:
    """Live regions by id. A region unregistered while a transfer uses it is released when the
    last transfer ends, so a client that goes away mid-copy cannot pull memory from under it."""

    def __init__(self, engine: DmaEngine):
        self.engine = engine
        self._regions: dict[int, Region] = {}
        # Ids start at random: a client holding an id from an earlier incarnation of the daemon
        # (hostd keeps regions registered between requests) must not name a region of this
        # one. 2**52 fits every client's integers (msgpack, a JSON double).
        self._ids = itertools.count(secrets.randbelow(1 << 52) + 1)

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, region: Region) -> Region:
        region.id = next(self._ids)
        self._regions[region.id] = region
        return region

    def get(self, region_id: int) -> Region:
        region = self._regions.get(region_id)
        if region is None:
            raise DmaError(errno.EINVAL, f"no registered region {region_id}")
        return region

    def remove(self, region_id: int, owner=None) -> None:
        region = self.get(region_id)
        if owner is not None and region.owner is not owner:
            raise DmaError(errno.EPERM, f"region {region_id} belongs to another client")
        del self._regions[region_id]
        region.closed = True
        if not region.refs:
            self.engine.release(region)

    def remove_owner(self, owner) -> int:
        ids = [r.id for r in self._regions.values() if r.owner is owner]
        for region_id in ids:
            self.remove(region_id)
        return len(ids)

    def acquire(self, region_id: int, offset: int, length: int) -> Region:
        region = self.get(region_id)
        region.check_span(offset, length)
        region.refs += 1
        return region

    def done(self, region: Region) -> None:
        region.refs -= 1
        if region.closed and not region.refs:
            self.engine.release(region)
