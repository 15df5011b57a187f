"""The DMA engine contract, run against each engine: the loopback engine, and the doca engine
on the DOCA API simulator (no BlueField here: the simulator stands in for the DPU's DMA)."""

import contextlib
import ctypes
import errno
import os
import random

import pytest
import trio

from bluecached.config import load_config
from bluecached.dma import DmaError, RegionTable, make_engine
from bluecached.tiers.objects import ZERO_CHUNK
from bluecached.wire.client import SharedRegion
from hostd.doca_export import HostExporter
from support import MiB, pattern, run

KiB = 1 << 10


def doca_settings(**changes):
    base = {"engine": "doca", "doca.library": "simulator", "doca.pci_address": "03:00.0",
            "doca.staging_size": "4MiB", "doca.max_chunk": "256KiB", "doca.queue_depth": 8}
    base.update({f"doca.{k}": v for k, v in changes.items()})
    return load_config(None, base).doca


class Host:
    """Client memory the engine can reach, made the way the engine's users make it."""

    def __init__(self, engine, length: int):
        self.shm = SharedRegion(length)
        self.engine = engine
        self.export = None
        if engine.name == "loopback":
            self.source = ("memfd", self.shm.fd, length)
        else:
            self.exporter = HostExporter("simulator", "b1:00.0")
            address = ctypes.addressof(ctypes.c_char.from_buffer(self.shm.map))
            self.export = self.exporter.export(address, length, writable=True)
            self.source = ("export", self.export.descriptor, address, length)

    @property
    def view(self) -> memoryview:
        return self.shm.view

    def close(self) -> None:
        if self.export is not None:
            self.exporter.unexport(self.export)
            self.exporter.close()
        self.shm.close()


ENGINES = {
    "loopback": lambda: make_engine("loopback"),
    "doca-thread": lambda: make_engine("doca", doca_settings(completion="thread")),
    "doca-poll": lambda: make_engine("doca", doca_settings(completion="poll")),
}


@pytest.fixture(params=list(ENGINES))
def serving(request):
    """Runs `test(engine, table, host)` inside trio with the engine's service started."""
    def go(test, host_length: int = 16 * MiB):
        async def main():
            engine = ENGINES[request.param]()
            table = RegionTable(engine)
            host = Host(engine, host_length)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(engine.serve)
                    await test(engine, table, host)
                    nursery.cancel_scope.cancel()
            finally:
                for region_id in list(table._regions):
                    table.remove(region_id)
                host.close()
        run(main)
    return go


def chunks(sizes):
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("offset, sizes", [
    (0, [MiB]),
    (4095, [1, 300 * KiB, 0, MiB + 17]),      # unaligned, odd pieces, an empty buffer
    (3 * MiB, [MiB] * 9),                     # more than the doca engine's staging (4 MiB)
    (5 * MiB + 1, [7 * KiB] * 40),            # many small store buffers in one piece
])
def test_bytes_round_trip_exactly(serving, offset, sizes):
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        total = sum(sizes)
        data = pattern(f"rt{offset}", total)
        host.view[offset:offset + total] = data
        store = chunks(sizes)
        await engine.to_store(region, offset, store)
        assert b"".join(bytes(c) for c in store) == data
        host.view[:] = bytes(len(host.view))
        await engine.from_store(store, region, offset + 1)
        assert host.view[offset + 1:offset + 1 + total] == data
        assert host.view[offset] == 0 and host.view[offset + 1 + total] == 0   # nothing beyond
    serving(test)


def test_a_new_file_gets_the_bytes_or_the_engine_says_it_cannot(serving):
    """to_new_file: the loopback engine writes a fresh memfd itself (the kernel's write);
    an engine that cannot says so and leaves the file as it was. A span past the region is
    refused, not cut short."""
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        data = pattern("new-file", 3 * MiB + 5)
        host.view[7:7 + len(data)] = data
        fd = os.memfd_create("new-file")
        try:
            os.ftruncate(fd, len(data))
            if await engine.to_new_file(region, 7, fd, len(data)):
                assert engine.name == "loopback"
                assert os.pread(fd, len(data) + 1, 0) == data
                with pytest.raises(DmaError) as refused:
                    await engine.to_new_file(region, len(host.view) - MiB, fd, MiB + 1)
                assert refused.value.errno == errno.EFAULT
            else:
                assert os.pread(fd, len(data), 0) == bytes(len(data))
        finally:
            os.close(fd)
    serving(test)


def test_read_only_store_buffers_can_be_sent(serving):
    """A hole reads as the shared zero chunk: a read-only buffer."""
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        host.view[:2 * MiB] = b"\xff" * (2 * MiB)
        await engine.from_store([memoryview(ZERO_CHUNK)[:MiB], memoryview(b"ab")], region, 10)
        assert host.view[:10] == b"\xff" * 10
        assert host.view[10:10 + MiB] == bytes(MiB)
        assert host.view[10 + MiB:12 + MiB] == b"ab"
    serving(test)


def test_concurrent_transfers_do_not_mix(serving):
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        rng = random.Random(5)
        jobs = []
        for i in range(24):
            length = rng.randrange(1, 600 * KiB)
            jobs.append((i * 640 * KiB, length, pattern(f"c{i}", length)))
        for start, length, data in jobs:
            host.view[start:start + length] = data
        results = {}

        async def pull(i, start, length):
            store = chunks([length // 2, length - length // 2])
            await engine.to_store(region, start, store)
            results[i] = b"".join(bytes(c) for c in store)

        async with trio.open_nursery() as nursery:
            for i, (start, length, _) in enumerate(jobs):
                nursery.start_soon(pull, i, start, length)
        assert all(results[i] == data for i, (_, _, data) in enumerate(jobs))
    serving(test)


def test_span_outside_the_region_is_efault_and_moves_nothing(serving):
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        with pytest.raises(DmaError) as e:
            table.acquire(region.id, len(host.view) - 10, 11)
        assert e.value.errno == errno.EFAULT
        with pytest.raises(DmaError) as e:
            table.acquire(region.id + 99, 0, 1)
        assert e.value.errno == errno.EINVAL
    serving(test)


def test_a_region_removed_mid_transfer_is_released_after_it(serving):
    async def test(engine, table, host):
        released = []
        original = engine.release
        engine.release = lambda region: (released.append(region.id), original(region))
        region = table.add(engine.register(host.source))
        host.view[:3 * MiB] = pattern("mid", 3 * MiB)
        held = table.acquire(region.id, 0, 3 * MiB)
        table.remove(region.id)
        assert released == []                       # a transfer still holds it
        store = chunks([3 * MiB])
        await engine.to_store(held, 0, store)
        assert bytes(store[0]) == pattern("mid", 3 * MiB)
        table.done(held)
        assert released == [region.id]
    serving(test)


def test_cancelling_a_waiter_does_not_abandon_its_buffers(serving):
    """Once to_store returns, cancelled or not, nothing writes into the store buffers any more
    (the store reuses them at once): the copy happened entirely, or not at all."""
    async def test(engine, table, host):
        region = table.add(engine.register(host.source))
        host.view[:8 * MiB] = pattern("cancel", 8 * MiB)
        store = chunks([8 * MiB])
        with trio.CancelScope() as scope:
            scope.cancel()
            with contextlib.suppress(trio.Cancelled):
                await engine.to_store(region, 0, store)
        snapshot = bytes(store[0])
        assert snapshot in (pattern("cancel", 8 * MiB), bytes(8 * MiB))
        later = chunks([8 * MiB])      # a transfer after it: any stray copy would land first
        await engine.to_store(region, 0, later)
        assert bytes(store[0]) == snapshot
    serving(test)
