"""The DOCA DMA engine (hardware mode): bluecached on the BlueField moves bytes over PCIe.

A region is host memory hostd exported with doca_mmap_export_pci; the descriptor reaches us
over the authenticated control channel (op `import_region`) and becomes a mmap with
doca_mmap_create_from_export. Store buffers are scattered 1 MiB chunks, so DMA goes through a
staging mmap of our own: a transfer is cut into pieces of at most `chunk` bytes (never above
the device's max_buf_size), each piece gets a staging slot, and up to `queue_depth` memcpy
tasks are in flight at once. Inbound pieces are copied from their slot into the store when
their task completes; outbound pieces are copied into their slot before submission.

Completions come from doca_pe_progress, which calls our callback on the thread calling it.
Either a dedicated thread owns every DOCA call of the data path (`completion: thread`, the
default: the event loop only queues a transfer and waits for one wake-up) or a trio task polls
(`completion: poll`); bench/doca_bench.py measures both. DOCA objects are not thread-safe, so
in either mode exactly one thread touches them while serving.
"""

import collections
import ctypes
import errno
import logging
import mmap
import threading
import time

import trio

from . import doca_binding
from .doca_binding import DocaError
from .engine import DmaEngine, DmaError, EngineUnavailable, Region

log = logging.getLogger("bluecached.dma.doca")

IDLE_SPINS = 64          # empty progress polls before the progress thread starts napping
NAP_S = 20e-6


class _Job:
    """One to_store/from_store call: its pieces and how many are done."""

    __slots__ = ("inbound", "remote", "pieces", "next", "submitted", "completed", "error",
                 "wake")

    def __init__(self, inbound: bool, remote, pieces: list, wake):
        self.inbound = inbound
        self.remote = remote          # (doca mmap, base address)
        self.pieces = pieces          # [(remote address, length, [(address, length, keep)])]
        self.next = 0
        self.submitted = 0
        self.completed = 0
        self.error: str | None = None
        self.wake = wake              # () -> None, called once when the job is finished

    @property
    def finished(self) -> bool:
        return (self.error is not None or self.next == len(self.pieces)) and \
            self.completed == self.submitted


def _address(view: memoryview, ffi) -> tuple[int, object]:
    keep = ffi.from_buffer(view)      # read-only views too (the shared zero chunk)
    return int(ffi.cast("uintptr_t", keep)), keep


class DocaEngine(DmaEngine):
    name = "doca"

    def __init__(self, settings):
        self.settings = settings
        self._undo: list = []
        try:
            self.doca = doca_binding.load(settings.library)
            self._open(settings)
        except (OSError, DocaError) as e:
            self._unwind()
            raise EngineUnavailable(str(e)) from None
        except BaseException:
            self._unwind()
            raise
        self.doca.set_completion_handler(self._completed)
        self._free_slots = list(range(self.slots))
        self._inflight: dict[int, tuple] = {}   # slot -> (job, piece, task, src, dst)
        self._pending: collections.deque[_Job] = collections.deque()
        self._incoming: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._poll_wake: trio.Event | None = None
        self._token = None
        self.pieces_moved = 0
        log.info("DMA engine doca: %s", self.describe())

    # -- setup and teardown ----------------------------------------------------------------

    def _new(self, ctype: str, make, what: str, destroy=None):
        out = self.doca.ffi.new(ctype + " *")
        self.doca.check(make(out), what)
        if destroy is not None:
            self._undo.append((destroy, out[0], what.replace("create", "destroy")))
        return out[0]

    def _open(self, settings) -> None:
        doca, lib, ffi = self.doca, self.doca.lib, self.doca.ffi
        self.dev = doca_binding.open_device(doca, settings.pci_address)
        self._undo.append((lib.doca_dev_close, self.dev, "doca_dev_close"))
        info = lib.doca_dev_as_devinfo(self.dev)
        doca.check(lib.doca_dma_cap_task_memcpy_is_supported(info),
                   f"DMA memcpy on {settings.pci_address}")
        max_buf = ffi.new("uint64_t *")
        doca.check(lib.doca_dma_cap_task_memcpy_get_max_buf_size(info, max_buf),
                   "doca_dma_cap_task_memcpy_get_max_buf_size")
        self.max_buf_size = max_buf[0]
        self.chunk = min(settings.max_chunk, self.max_buf_size)
        self.slots = max(1, settings.staging_size // self.chunk)
        self.pe = self._new("struct doca_pe *", lib.doca_pe_create, "doca_pe_create",
                            lib.doca_pe_destroy)
        self.dma = self._new("struct doca_dma *", lambda out: lib.doca_dma_create(self.dev, out),
                             "doca_dma_create", lib.doca_dma_destroy)
        self.ctx = lib.doca_dma_as_ctx(self.dma)
        max_tasks = ffi.new("uint32_t *")
        doca.check(lib.doca_dma_cap_get_max_num_tasks(self.dma, max_tasks),
                   "doca_dma_cap_get_max_num_tasks")
        self.queue_depth = min(settings.queue_depth, self.slots, max_tasks[0])
        doca.check(lib.doca_dma_task_memcpy_set_conf(self.dma, doca.completion_cb,
                                                     doca.completion_cb, self.queue_depth),
                   "doca_dma_task_memcpy_set_conf")
        doca.check(lib.doca_pe_connect_ctx(self.pe, self.ctx), "doca_pe_connect_ctx")
        doca.check(lib.doca_ctx_start(self.ctx), "doca_ctx_start")
        self._undo.append((self._stop_ctx, None, "doca_ctx_stop"))
        # Two buffers per task in flight.
        self.inventory = self._new(
            "struct doca_buf_inventory *",
            lambda out: lib.doca_buf_inventory_create(2 * self.queue_depth, out),
            "doca_buf_inventory_create", lib.doca_buf_inventory_destroy)
        doca.check(lib.doca_buf_inventory_start(self.inventory), "doca_buf_inventory_start")
        self._undo.append((lib.doca_buf_inventory_stop, self.inventory,
                           "doca_buf_inventory_stop"))
        self.staging = mmap.mmap(-1, self.slots * self.chunk, mmap.MAP_PRIVATE | mmap.MAP_POPULATE)
        self._undo.append((lambda m: m.close(), self.staging, "staging unmap"))
        self.staging_address = ctypes.addressof(ctypes.c_char.from_buffer(self.staging))
        self.local = self._new("struct doca_mmap *", lib.doca_mmap_create, "doca_mmap_create",
                               lib.doca_mmap_destroy)
        doca.check(lib.doca_mmap_add_dev(self.local, self.dev), "doca_mmap_add_dev")
        doca.check(lib.doca_mmap_set_permissions(self.local,
                                                 lib.DOCA_ACCESS_FLAG_LOCAL_READ_WRITE),
                   "doca_mmap_set_permissions")
        doca.check(lib.doca_mmap_set_memrange(self.local, ffi.cast("void *", self.staging_address),
                                              len(self.staging)), "doca_mmap_set_memrange")
        doca.check(lib.doca_mmap_start(self.local), "doca_mmap_start")
        self._undo.append((lib.doca_mmap_stop, self.local, "doca_mmap_stop"))

    def _stop_ctx(self, _=None) -> int:
        """doca_ctx_stop, progressing until IDLE when tasks are still in flight."""
        lib, ffi = self.doca.lib, self.doca.ffi
        state = ffi.new("enum doca_ctx_states *")
        if lib.doca_ctx_get_state(self.ctx, state) == 0 and state[0] == lib.DOCA_CTX_STATE_IDLE:
            return 0
        err = lib.doca_ctx_stop(self.ctx)
        if err == lib.DOCA_ERROR_IN_PROGRESS:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                lib.doca_pe_progress(self.pe)
                lib.doca_ctx_get_state(self.ctx, state)
                if state[0] == lib.DOCA_CTX_STATE_IDLE:
                    return 0
            return lib.DOCA_ERROR_TIME_OUT
        return err

    def _unwind(self) -> None:
        while self._undo:
            destroy, obj, what = self._undo.pop()
            err = destroy(obj)
            if err:  # logged, not raised: the rest must still be let go
                log.warning("%s", self.doca.error(err, what))

    def describe(self) -> str:
        return (f"{self.doca.description}; device {self.settings.pci_address}; chunk "
                f"{self.chunk >> 10} KiB (max_buf_size {self.max_buf_size >> 10} KiB); "
                f"queue depth {self.queue_depth}; staging {len(self.staging) >> 20} MiB; "
                f"completion {self.settings.completion}")

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            if self.settings.completion == "thread":
                self._thread = threading.Thread(target=self._thread_main,
                                                name="doca-progress", daemon=True)
                self._thread.start()
                task_status.started()
                await trio.sleep_forever()
            else:
                task_status.started()
                await self._poll_main()
        finally:
            self.close()

    def close(self) -> None:
        """Finishes what is in flight, fails what was not submitted, destroys everything."""
        if self._thread is not None:
            with self._cond:
                self._stopping = True
                self._cond.notify()
            self._thread.join()
            self._thread = None
        self._stopping = True
        unsubmitted = list(self._pending) + list(self._incoming)
        self._pending.clear()
        self._incoming.clear()
        for job in unsubmitted:
            job.error = job.error or "the DMA engine is stopping"
            job.next = len(job.pieces)
            if job.finished:
                job.wake()
        if self._undo:
            err = self._stop_ctx()   # progresses what is in flight to its completion callback
            if err:
                log.warning("%s", self.doca.error(err, "doca_ctx_stop"))
            self._unwind()
        for job, *_ in self._inflight.values():
            job.error = "the DMA engine stopped"
            job.wake()
        self._inflight.clear()

    # -- regions ---------------------------------------------------------------------------

    def register(self, source, owner=None) -> Region:
        """source: ("export", descriptor, host address, length) from doca_mmap_export_pci."""
        kind, descriptor, address, length = source
        doca, lib, ffi = self.doca, self.doca.lib, self.doca.ffi
        if kind != "export" or not descriptor or length <= 0:
            raise DmaError(errno.EINVAL, "a DOCA region needs an export descriptor and a length")
        out = ffi.new("struct doca_mmap **")
        err = lib.doca_mmap_create_from_export(ffi.NULL, descriptor, len(descriptor), self.dev,
                                               out)
        if err:
            raise DmaError(errno.EINVAL, str(doca.error(err, "doca_mmap_create_from_export")))
        base, size = ffi.new("void **"), ffi.new("size_t *")
        err = lib.doca_mmap_get_memrange(out[0], base, size)
        start = int(ffi.cast("uintptr_t", base[0]))
        if err or not (start <= address and address + length <= start + size[0]):
            lib.doca_mmap_destroy(out[0])
            raise DmaError(errno.EINVAL, f"span {address:#x}+{length} is not inside the export")
        return Region(length, "export", (out[0], address), owner)

    def release(self, region: Region) -> None:
        err = self.doca.lib.doca_mmap_destroy(region.handle[0])
        if err:
            log.warning("%s", self.doca.error(err, f"doca_mmap_destroy of region {region.id}"))

    # -- transfers -------------------------------------------------------------------------

    async def to_store(self, region, offset, dst) -> None:
        await self._transfer(True, region, offset, dst)

    async def from_store(self, src, region, offset) -> None:
        await self._transfer(False, region, offset, src)

    def _pieces(self, region: Region, offset: int, views) -> list:
        ffi, chunk = self.doca.ffi, self.chunk
        pieces, segments, piece_start, piece_len = [], [], region.handle[1] + offset, 0
        for view in views:
            address, keep = _address(view, ffi)
            pos, size = 0, len(view)
            while pos < size:
                n = min(size - pos, chunk - piece_len)
                segments.append((address + pos, n, keep))
                pos += n
                piece_len += n
                if piece_len == chunk:
                    pieces.append((piece_start, piece_len, segments))
                    piece_start, segments, piece_len = piece_start + piece_len, [], 0
        if piece_len:
            pieces.append((piece_start, piece_len, segments))
        return pieces

    async def _transfer(self, inbound: bool, region: Region, offset: int, views) -> None:
        if self._stopping or self._token is None:
            raise DmaError(errno.ESHUTDOWN, "the DMA engine is not serving")
        pieces = self._pieces(region, offset, views)
        if not pieces:
            return
        done = trio.Event()
        if self._thread is not None:
            token = self._token
            job = _Job(inbound, region.handle, pieces, lambda: token.run_sync_soon(done.set))
            with self._cond:
                self._incoming.append(job)
                self._cond.notify()
        else:
            job = _Job(inbound, region.handle, pieces, done.set)
            self._pending.append(job)
            if self._poll_wake is not None:
                self._poll_wake.set()
        # Once submitted, DMA writes into these buffers whatever happens to this task: it
        # must not return (and let the store reuse them) before the engine is done.
        with trio.CancelScope(shield=True):
            await done.wait()
        if job.error is not None:
            raise DmaError(errno.EIO, f"DMA {'from' if inbound else 'to'} region {region.id} "
                                      f"failed: {job.error}")

    # -- the data path: runs on exactly one thread -----------------------------------------

    def _fill(self) -> None:
        """Submits pieces while there are staging slots and task credits."""
        pending = self._pending
        while pending and len(self._inflight) < self.queue_depth:
            job = pending[0]
            if job.error is not None or job.next == len(job.pieces):
                pending.popleft()
                if job.finished:
                    job.wake()
                continue
            piece = job.pieces[job.next]
            job.next += 1
            self._submit(job, piece)

    def _submit(self, job: _Job, piece) -> None:
        doca, lib = self.doca, self.doca.lib
        ffi = doca.ffi
        slot = self._free_slots.pop()
        local = self.staging_address + slot * self.chunk
        remote_address, length, segments = piece
        if not job.inbound:
            pos = local
            for address, n, _keep in segments:
                ctypes.memmove(pos, address, n)
                pos += n
        bufs = ffi.new("struct doca_buf *[2]")
        task = ffi.new("struct doca_dma_task_memcpy **")
        remote_mmap = job.remote[0]
        local_p, remote_p = ffi.cast("void *", local), ffi.cast("void *", remote_address)
        inv = self.inventory
        if job.inbound:   # host -> staging
            steps = ((lib.doca_buf_inventory_buf_get_by_args, (inv, remote_mmap, remote_p, length,
                                                               remote_p, length, bufs + 0)),
                     (lib.doca_buf_inventory_buf_get_by_args, (inv, self.local, local_p, length,
                                                               local_p, 0, bufs + 1)))
        else:             # staging -> host
            steps = ((lib.doca_buf_inventory_buf_get_by_args, (inv, self.local, local_p, length,
                                                               local_p, length, bufs + 0)),
                     (lib.doca_buf_inventory_buf_get_by_args, (inv, remote_mmap, remote_p, length,
                                                               remote_p, 0, bufs + 1)))
        got = 0
        err = 0
        for fn, args in steps:
            err = fn(*args)
            if err:
                break
            got += 1
        what = "doca_buf_inventory_buf_get_by_args"
        if not err:
            err = lib.doca_dma_task_memcpy_alloc_init(self.dma, bufs[0], bufs[1],
                                                      doca.data(slot), task)
            what = "doca_dma_task_memcpy_alloc_init"
        if not err:
            err = lib.doca_task_submit(lib.doca_dma_task_memcpy_as_task(task[0]))
            what = "doca_task_submit"
            if err:   # a failed submission leaves the task ours
                lib.doca_task_free(lib.doca_dma_task_memcpy_as_task(task[0]))
        if err:
            for i in range(got):
                lib.doca_buf_dec_refcount(bufs[i], ffi.NULL)
            self._free_slots.append(slot)
            job.error = str(doca.error(err, what))
            return
        job.submitted += 1
        self._inflight[slot] = (job, piece, bufs[0], bufs[1])

    def _completed(self, task, slot: int) -> None:
        """The memcpy callback (success and error alike), inside doca_pe_progress."""
        lib, ffi = self.doca.lib, self.doca.ffi
        try:
            job, piece, src, dst = self._inflight.pop(slot)
            status = lib.doca_task_get_status(lib.doca_dma_task_memcpy_as_task(task))
            lib.doca_task_free(lib.doca_dma_task_memcpy_as_task(task))
            lib.doca_buf_dec_refcount(src, ffi.NULL)
            lib.doca_buf_dec_refcount(dst, ffi.NULL)
            if status:
                job.error = job.error or str(self.doca.error(status, "DMA memcpy task"))
            elif job.inbound and job.error is None:
                pos = self.staging_address + slot * self.chunk
                for address, n, _keep in piece[2]:
                    ctypes.memmove(address, pos, n)
                    pos += n
            self._free_slots.append(slot)
            job.completed += 1
            self.pieces_moved += 1
            if job.finished and (not self._pending or self._pending[0] is not job):
                job.wake()
        except Exception:  # nothing may escape into DOCA's progress loop
            log.exception("DMA completion handling failed")

    def _thread_main(self) -> None:
        lib = self.doca.lib
        idle = 0
        while True:
            with self._cond:
                while not (self._incoming or self._pending or self._inflight or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._inflight:
                    return
                self._pending.extend(self._incoming)
                self._incoming.clear()
            if not self._stopping:
                self._fill()
            if lib.doca_pe_progress(self.pe):
                idle = 0
            else:
                idle += 1
                if idle > IDLE_SPINS:
                    time.sleep(NAP_S)

    async def _poll_main(self) -> None:
        lib = self.doca.lib
        while True:
            if not (self._pending or self._inflight):
                self._poll_wake = trio.Event()
                await self._poll_wake.wait()
                self._poll_wake = None
            self._fill()
            lib.doca_pe_progress(self.pe)
            await trio.lowlevel.checkpoint()
