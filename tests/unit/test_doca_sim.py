"""The DOCA API simulator (native/doca_sim) keeps the DOCA semantics the engine relies on, and
the doca engine copes with the failures DOCA reports. This is the simulator: no BlueField."""

import ctypes
import errno
import subprocess
import sys
import textwrap

import pytest
import trio
from test_dma_engines import doca_settings

from bluecached.dma import DmaError, RegionTable, doca_binding, make_engine
from bluecached.wire.client import SharedRegion
from hostd.doca_export import HostExporter
from support import MiB, pattern, run


@pytest.fixture
def doca():
    return doca_binding.load("simulator")


class Raw:
    """A DMA context set up by hand, so each DOCA call can be checked."""

    def __init__(self, doca, tasks=4, bufs=8, connect=True):
        self.doca, lib, ffi = doca, doca.lib, doca.ffi
        self.lib, self.ffi = lib, ffi
        self.dev = doca_binding.open_device(doca, "03:00.0")
        self.completions = []
        doca.set_completion_handler(lambda task, data: self.completions.append((task, data)))
        pe, dma, inv, m = (ffi.new(t) for t in ("struct doca_pe **", "struct doca_dma **",
                                                 "struct doca_buf_inventory **",
                                                 "struct doca_mmap **"))
        doca.check(lib.doca_pe_create(pe), "pe")
        doca.check(lib.doca_dma_create(self.dev, dma), "dma")
        self.pe, self.dma = pe[0], dma[0]
        self.ctx = lib.doca_dma_as_ctx(self.dma)
        doca.check(lib.doca_dma_task_memcpy_set_conf(self.dma, doca.completion_cb,
                                                     doca.completion_cb, tasks), "conf")
        if connect:
            doca.check(lib.doca_pe_connect_ctx(self.pe, self.ctx), "connect")
        doca.check(lib.doca_buf_inventory_create(bufs, inv), "inventory")
        self.inv = inv[0]
        doca.check(lib.doca_buf_inventory_start(self.inv), "inventory start")
        self.memory = SharedRegion(8 * MiB)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory.map))
        doca.check(lib.doca_mmap_create(m), "mmap")
        self.mmap = m[0]
        doca.check(lib.doca_mmap_add_dev(self.mmap, self.dev), "add_dev")
        doca.check(lib.doca_mmap_set_permissions(self.mmap,
                                                 lib.DOCA_ACCESS_FLAG_LOCAL_READ_WRITE), "perm")
        doca.check(lib.doca_mmap_set_memrange(self.mmap, ffi.cast("void *", self.base),
                                              8 * MiB), "range")
        doca.check(lib.doca_mmap_start(self.mmap), "mmap start")

    def state(self) -> int:
        s = self.ffi.new("enum doca_ctx_states *")
        self.doca.check(self.lib.doca_ctx_get_state(self.ctx, s), "state")
        return s[0]

    def buf(self, offset: int, length: int, data_len: int):
        out = self.ffi.new("struct doca_buf **")
        p = self.ffi.cast("void *", self.base + offset)
        err = self.lib.doca_buf_inventory_buf_get_by_args(self.inv, self.mmap, p, length, p,
                                                         data_len, out)
        return err, out[0]

    def task(self, src_offset: int, dst_offset: int, length: int, tag: int):
        _, src = self.buf(src_offset, length, length)
        _, dst = self.buf(dst_offset, length, 0)
        out = self.ffi.new("struct doca_dma_task_memcpy **")
        err = self.lib.doca_dma_task_memcpy_alloc_init(self.dma, src, dst, self.doca.data(tag),
                                                       out)
        return err, out[0], (src, dst)

    def progress_until(self, done) -> None:
        for _ in range(100000):
            if done():
                return
            self.lib.doca_pe_progress(self.pe)
        raise AssertionError("no progress")


def test_error_names_and_descriptions_are_docas(doca):
    e = doca.error(doca.lib.DOCA_ERROR_TOO_BIG, "submit")
    assert (e.code, e.name) == (27, "DOCA_ERROR_TOO_BIG")
    assert str(e) == "submit: DOCA_ERROR_TOO_BIG (Requested operation too big to be contained)"
    assert doca.error(26, "x").name == "DOCA_ERROR_IN_PROGRESS"
    assert doca.lib.DOCA_ERROR_NO_MEMORY == 7 and doca.lib.DOCA_ERROR_AGAIN == 5


def test_context_state_machine_and_callbacks_only_inside_progress(doca):
    raw = Raw(doca)
    lib = raw.lib
    assert raw.state() == lib.DOCA_CTX_STATE_IDLE
    assert lib.doca_ctx_stop(raw.ctx) == lib.DOCA_ERROR_BAD_STATE
    doca.check(lib.doca_ctx_start(raw.ctx), "start")
    assert raw.state() == lib.DOCA_CTX_STATE_RUNNING
    raw.memory.view[:MiB] = pattern("sm", MiB)
    tasks = []
    for i in range(3):
        err, task, _ = raw.task(0, (i + 1) * MiB, MiB, tag=100 + i)
        assert err == 0
        doca.check(lib.doca_task_submit(lib.doca_dma_task_memcpy_as_task(task)), "submit")
        tasks.append(task)
    # the copies may be done by now, but no callback runs outside doca_pe_progress
    assert raw.completions == []
    assert lib.doca_ctx_stop(raw.ctx) == lib.DOCA_ERROR_IN_PROGRESS
    assert raw.state() == lib.DOCA_CTX_STATE_STOPPING
    submitted_while_stopping = raw.task(0, 5 * MiB, 10, tag=9)[1]
    assert lib.doca_task_submit(lib.doca_dma_task_memcpy_as_task(
        submitted_while_stopping)) == lib.DOCA_ERROR_BAD_STATE
    lib.doca_task_free(lib.doca_dma_task_memcpy_as_task(submitted_while_stopping))
    raw.progress_until(lambda: raw.state() == lib.DOCA_CTX_STATE_IDLE)
    assert sorted(data for _, data in raw.completions) == [100, 101, 102]
    for i in range(3):
        assert raw.memory.view[(i + 1) * MiB:(i + 2) * MiB] == pattern("sm", MiB)
    # destroy order: a connected PE cannot go before its context
    assert lib.doca_pe_destroy(raw.pe) == lib.DOCA_ERROR_IN_USE


def test_start_needs_a_progress_engine(doca):
    raw = Raw(doca, connect=False)
    assert raw.lib.doca_ctx_start(raw.ctx) == raw.lib.DOCA_ERROR_NOT_CONNECTED


def test_too_big_above_max_buf_size_and_the_task_stays_ours(doca, monkeypatch):
    monkeypatch.setenv("DOCA_SIM_MAX_BUF_SIZE", str(MiB))
    raw = Raw(doca, tasks=1)
    lib = raw.lib
    size = raw.ffi.new("uint64_t *")
    doca.check(lib.doca_dma_cap_task_memcpy_get_max_buf_size(
        lib.doca_dev_as_devinfo(raw.dev), size), "cap")
    assert size[0] == MiB
    doca.check(lib.doca_ctx_start(raw.ctx), "start")
    err, task, _ = raw.task(0, 2 * MiB, MiB + 1, tag=1)
    assert err == 0
    as_task = lib.doca_dma_task_memcpy_as_task(task)
    assert lib.doca_task_submit(as_task) == lib.DOCA_ERROR_TOO_BIG
    lib.doca_task_free(as_task)                          # ours to free: the pool has it back
    assert raw.task(0, 2 * MiB, MiB, tag=2)[0] == 0


def test_no_memory_when_the_task_pool_or_the_inventory_is_empty(doca):
    raw = Raw(doca, tasks=2, bufs=5)
    lib = raw.lib
    doca.check(lib.doca_ctx_start(raw.ctx), "start")
    assert raw.task(0, MiB, 10, 1)[0] == 0
    assert raw.task(0, MiB, 10, 2)[0] == 0
    assert raw.task(0, MiB, 10, 3)[0] == lib.DOCA_ERROR_NO_MEMORY     # 2 tasks configured
    assert raw.buf(0, 10, 10)[0] == lib.DOCA_ERROR_NO_MEMORY          # 6 of 5 bufs taken
    assert raw.buf(8 * MiB - 4, 8, 8)[0] == lib.DOCA_ERROR_INVALID_VALUE   # outside the mmap


CHILD = textwrap.dedent("""
    import ctypes, sys
    from bluecached.wire.client import SharedRegion
    from hostd.doca_export import HostExporter
    mem = SharedRegion({size})
    mem.view[:] = bytes(range(256)) * ({size} // 256)
    ex = HostExporter("simulator", "b1:00.0")
    address = ctypes.addressof(ctypes.c_char.from_buffer(mem.map))
    export = ex.export(address, {size}, writable={writable})
    print(export.descriptor.hex(), address, flush=True)
    sys.stdin.readline()                     # the parent has moved its bytes
    print(bytes(mem.view[:16]).hex(), flush=True)
    sys.stdin.readline()
""")


class Exporter:
    """Another process exporting 4 MiB of its memory, as hostd does."""

    def __init__(self, writable=True, size=4 * MiB):
        self.size = size
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(size=size, writable=writable)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        desc, address = self.proc.stdout.readline().split()
        self.source = ("export", bytes.fromhex(desc), int(address), size)

    def step(self) -> str:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate("\n" * 2, timeout=30)   # lets it exit, closes the pipes


def with_engine(test, **settings):
    async def main():
        engine = make_engine("doca", doca_settings(**settings))
        table = RegionTable(engine)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.serve)
            await test(engine, table)
            nursery.cancel_scope.cancel()
    run(main)


def test_export_used_from_another_process():
    child = Exporter()

    async def test(engine, table):
        region = table.add(engine.register(child.source))
        store = [memoryview(bytearray(MiB)) for _ in range(4)]
        await engine.to_store(region, 0, store)
        assert b"".join(bytes(s) for s in store) == bytes(range(256)) * (4 * MiB // 256)
        await engine.from_store([memoryview(b"written by the dpu")], region, 0)
        assert child.step() == b"written by the dpu"[:16].hex()
        table.remove(region.id)

    try:
        with_engine(test)
    finally:
        child.end()


def test_a_read_only_export_cannot_be_written():
    child = Exporter(writable=False)

    async def test(engine, table):
        region = table.add(engine.register(child.source))
        with pytest.raises(DmaError) as e:
            await engine.from_store([memoryview(b"x" * 100)], region, 0)
        assert e.value.errno == errno.EIO and "DOCA_ERROR_NOT_PERMITTED" in e.value.strerror
        store = [memoryview(bytearray(256))]
        await engine.to_store(region, 0, store)          # reading it is fine
        assert bytes(store[0]) == bytes(range(256))
        table.remove(region.id)

    try:
        with_engine(test)
    finally:
        child.end()


def test_an_exporter_that_died_fails_transfers_not_the_engine():
    child = Exporter()
    descriptor = child.source

    async def test(engine, table):
        region = table.add(engine.register(descriptor))
        child.step()
        child.end()                                   # the host process is gone
        with pytest.raises(DmaError) as e:
            await engine.to_store(region, 0, [memoryview(bytearray(MiB))])
        assert e.value.errno == errno.EIO and "DOCA_ERROR_IO_FAILED" in e.value.strerror
        with pytest.raises(DmaError) as e:           # importing it again: it is gone
            engine.register(descriptor)
        assert "DOCA_ERROR_NOT_FOUND" in e.value.strerror
        table.remove(region.id)
        own = SharedRegion(MiB)                       # and the engine still works
        exporter = HostExporter("simulator", "b1:00.0")
        address = ctypes.addressof(ctypes.c_char.from_buffer(own.map))
        export = exporter.export(address, MiB, writable=True)
        mine = table.add(engine.register(("export", export.descriptor, address, MiB)))
        await engine.from_store([memoryview(b"alive")], mine, 0)
        assert own.view[:5] == b"alive"
        table.remove(mine.id)
        exporter.unexport(export)
        own.close()

    with_engine(test)


def test_bad_descriptors_are_refused_clearly():
    async def test(engine, table):
        for descriptor, length in ((b"garbage", 10), (b"DOCASIM1" + bytes(56), 10)):
            with pytest.raises(DmaError) as e:
                engine.register(("export", descriptor, 0, length))
            assert e.value.errno == errno.EINVAL
            assert "doca_mmap_create_from_export: DOCA_ERROR_INVALID_VALUE" in e.value.strerror

    with_engine(test)


def test_stop_with_transfers_in_flight_completes_them():
    """Cancelling the engine's service mid-transfer: doca_ctx_stop answers IN_PROGRESS, the
    engine progresses until IDLE, and the waiting transfer still gets all its bytes."""
    memory = SharedRegion(32 * MiB)
    memory.view[:] = pattern("stop", 32 * MiB)
    exporter = HostExporter("simulator", "b1:00.0")
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory.map))
    export = exporter.export(address, 32 * MiB, writable=True)
    store = [memoryview(bytearray(MiB)) for _ in range(32)]
    outcome, region_ids = [], []

    async def main():
        engine = make_engine("doca", doca_settings(completion="poll"))
        table = RegionTable(engine)
        region = table.add(engine.register(("export", export.descriptor, address, 32 * MiB)))
        region_ids.append(region.id)

        async def pull():
            try:
                await engine.to_store(region, 0, store)
                outcome.append("done")
            except DmaError as e:
                outcome.append(e.strerror)

        async with trio.open_nursery() as services:
            await services.start(engine.serve)
            async with trio.open_nursery() as clients:
                clients.start_soon(pull)
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
                services.cancel_scope.cancel()       # the daemon stops
        assert engine._undo == []                     # everything destroyed
        table.remove(region.id)

    run(main)
    exporter.unexport(export)
    # every piece submitted before the stop arrived; those not yet submitted are refused
    assert outcome in (["done"], [f"DMA from region {region_ids[0]} failed: the DMA engine is "
                                  "stopping"])
    if outcome == ["done"]:
        assert b"".join(bytes(s) for s in store) == pattern("stop", 32 * MiB)
    memory.close()
