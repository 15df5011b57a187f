"""Shared test helpers: an in-process store over real files, and byte patterns."""

import errno
import hashlib
import os
import stat
from pathlib import Path

import trio

from bluecached.client import SharedRegion
from bluecached.dma import RegionTable
from bluecached.dma.loopback import LoopbackEngine
from bluecached.dram import DramPool
from bluecached.journal import Journal
from bluecached.namespace import ROOT_INO, FsError
from bluecached.nvme import SegmentStore
from bluecached.store import Store
from bluecached.tiers import Tiers, Watermarks

MiB = 1 << 20


def pattern(seed: str, size: int) -> bytes:
    """Deterministic bytes that differ per seed and per position (so shifts show)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}:{counter}".encode(), digest_size=64).digest() * 256
        counter += 1
    return bytes(out[:size])


def run(fn, *args):
    return trio.run(fn, *args, strict_exception_groups=True)


class Harness:
    """A Store wired as the daemon wires it, minus sockets: ops are called directly."""

    def __init__(self, root: Path, dram: int = 64 * MiB, nvme: int = 256 * MiB,
                 segment: int = 64 * MiB, write_through: bool = False, marks=(0.9, 0.75),
                 nvme_marks=(0.95, 0.85), tmp_max_age: float = 3600, region_size: int = 64 * MiB):
        self.root = root
        self.kw = dict(dram=dram, nvme=nvme, segment=segment, write_through=write_through,
                       marks=marks, nvme_marks=nvme_marks, tmp_max_age=tmp_max_age)
        self.engine = LoopbackEngine()
        self.regions = RegionTable(self.engine)
        self.shm = SharedRegion(region_size)
        self.region = self.regions.add(self.engine.register((self.shm.fd, region_size)))
        self.events: list[tuple[str, dict]] = []
        self.store = self._open()

    def _open(self) -> Store:
        kw = self.kw
        nvme = journal = None
        if kw["nvme"]:
            nvme = SegmentStore(self.root / "nvme", kw["nvme"], kw["segment"], "auto", True)
            journal = Journal(self.root / "nvme", True)
        tiers = Tiers(DramPool(kw["dram"]), Watermarks(*kw["marks"]), nvme,
                      Watermarks(*kw["nvme_marks"]), journal, kw["write_through"], 1 << 30,
                      remove_object=lambda node, reason: store.remove_object(node, reason))
        store = Store(tiers, self.engine, tmp_max_age=kw["tmp_max_age"],
                      publish=lambda event, **f: self.events.append((event, f)))
        store.load()
        return store

    def reopen(self, clean: bool = True) -> Store:
        """A daemon restart: clean (SIGTERM: flush + checkpoint) or not (SIGKILL)."""
        old = self.store
        if clean:
            run(old.flush_all)
            old.checkpoint()
        if old.tiers.nvme:
            old.tiers.nvme.close()
            old.tiers.journal.close()
        self.store = self._open()
        return self.store

    def serve(self, fn, *args):
        """Runs fn with the daemon's background tasks (write-behind, evictor) alongside."""
        async def with_workers():
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(self.store.tiers.writeback_worker)
                nursery.start_soon(self.store.tiers.evictor)
                result = await fn(*args)
                nursery.cancel_scope.cancel()
            return result
        return run(with_workers)

    # -- path helpers (what a client would do) ---------------------------------------------

    def _parent(self, path: str) -> tuple[int, bytes]:
        parts = [p.encode() for p in path.strip("/").split("/")]
        ino = ROOT_INO
        for part in parts[:-1]:
            try:
                ino = self.store.mkdir(ino, part, 0o755, 0, 0).ino
            except FsError as e:
                if e.errno != errno.EEXIST:
                    raise
                ino = self.store.lookup(ino, part).ino
        return ino, parts[-1]

    async def put(self, path: str, data: bytes, flags: int = os.O_WRONLY | os.O_TRUNC) -> None:
        parent, name = self._parent(path)
        handle = await self.store.create(parent, name, 0o644, 0, 0, flags | os.O_CREAT)
        await self.write(handle.fh, 0, data)
        self.store.release(handle.fh)

    async def write(self, fh: int, offset: int, data: bytes, step: int = MiB) -> None:
        for pos in range(0, len(data), step):
            piece = data[pos:pos + step]
            self.shm.view[:len(piece)] = piece
            await self.store.write(fh, offset + pos, len(piece), self.region, 0)

    async def read(self, fh: int, offset: int, length: int, step: int = MiB) -> bytes:
        out = bytearray()
        while len(out) < length:
            n = await self.store.read(fh, offset + len(out), min(step, length - len(out)),
                                      self.region, 0)
            if n == 0:
                break
            out += self.shm.view[:n]
        return bytes(out)

    async def get(self, path: str) -> bytes:
        node = self.store.ns.resolve(path)
        handle = await self.store.open(node.ino, os.O_RDONLY)
        try:
            return await self.read(handle.fh, 0, node.size)
        finally:
            self.store.release(handle.fh)

    async def settle(self) -> None:
        """Runs write-behind for everything dirty (what the workers do in the daemon)."""
        tiers = self.store.tiers
        for node in list(tiers.lru_dram.values()):
            node.obj.queued = False
            if node.obj.dirty and not node.obj.writers and node.parent is not None:
                async with node.obj.content_lock():
                    await tiers.writeback(node)

    def check_consistency(self) -> None:
        """Post-condition: the tiers' bookkeeping agrees with the objects and the pool."""
        store = self.store
        tiers = store.tiers
        chunks = 0
        dirty = 0
        logical = 0
        for node in store.ns.inodes.values():
            if node.is_dir:
                assert stat.S_ISDIR(node.mode)
                for name, (_, child) in node.children.items():
                    assert store.ns.inodes[child].parent == node.ino
                    assert store.ns.inodes[child].name == name
                continue
            obj = node.obj
            logical += node.size
            if obj.chunks is not None:
                assert node.ino in tiers.lru_dram
                chunks += sum(c is not None for c in obj.chunks) + len(obj.deferred)
            else:
                assert node.ino not in tiers.lru_dram
            if obj.dirty:
                dirty += node.size
            assert (node.ino in tiers.lru_nvme) == obj.persisted
        assert tiers.dram.used_bytes == chunks * MiB
        assert tiers.dirty_bytes == dirty
        assert store.logical_bytes == logical

    def close(self) -> None:
        if self.store.tiers.nvme:
            self.store.tiers.nvme.close()
            self.store.tiers.journal.close()
        self.regions.remove(self.region.id)
        self.shm.close()
