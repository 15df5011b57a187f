"""The loopback engine (embedded mode): regions are memfds shared with the client, or CUDA
device memory named by an IPC handle.

hostd passes each memfd over `<state_dir>/dma.sock` (SCM_RIGHTS); the daemon maps it and copies
with memcpy. The memfd must be sealed against shrinking: a client that truncated a mapped file
would make the daemon fault (SIGBUS) on the next copy. CUDA IPC handles arrive on the control
channel (`import_cuda_ipc`); the GPU copies (dma/cuda.py).
"""

import array
import ctypes
import errno
import fcntl
import gc
import logging
import mmap
import os
import socket

import msgpack
import trio

from ..wire.unix_listener import serve_private
from . import _stream_copy
from .engine import DmaEngine, DmaError, Region

MAX_REGION = 1 << 40
POPULATE_LIMIT = 256 << 20
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x0010   # F_SEAL_FUTURE_WRITE (Linux 5.1; not in fcntl)


class LoopbackEngine(DmaEngine):
    name = "loopback"

    def __init__(self, cuda_device: int = 0):
        self.cuda_device = cuda_device
        self._cuda = None          # the CudaContext, once a CUDA region was registered

    def describe(self) -> str:
        return "shared memfds copied by the CPU, CUDA memory by the GPU (embedded mode, no DPU)"

    def register(self, source, owner=None) -> Region:
        """source: (kind, fd, length) with kind "memfd" or "dmabuf". The fd is the caller's
        to close: the mapping keeps the memory. Or ("cuda_ipc", handle, offset, length): this
        blocks (it may initialise CUDA), so call it from a worker thread."""
        if source[0] == "cuda_ipc":
            return self._register_cuda(*source[1:], owner=owner)
        kind, fd, length = source
        if not 0 < length <= MAX_REGION:
            raise DmaError(errno.EINVAL, f"region length {length} is out of range")
        seals = 0
        try:
            size = os.fstat(fd).st_size
            if kind == "memfd":
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                if not seals & fcntl.F_SEAL_SHRINK:
                    raise DmaError(errno.EINVAL, "region memfd must be sealed with F_SEAL_SHRINK")
            elif kind != "dmabuf":
                raise DmaError(errno.EOPNOTSUPP, f"the loopback engine cannot map {kind!r} memory")
        except OSError as e:
            if isinstance(e, DmaError):
                raise
            raise DmaError(errno.EBADF,
                           f"region fd is not a sealable memfd: {e.strerror}") from None
        if kind == "memfd" and size < length:
            raise DmaError(errno.EINVAL, f"region memfd holds {size} bytes, {length} claimed")
        try:
            # MAP_POPULATE: one pass of page-table setup instead of a fault per page on the
            # first copy (a 32 MiB block is 8192 faults). Not for huge regions: populating
            # would allocate every page of a sparse memfd.
            populate = mmap.MAP_POPULATE if length <= POPULATE_LIMIT else 0
            # A memfd sealed against writing cannot be mapped shared and writable; a private
            # mapping reads the same pages (nothing writes them: the seal says so) and serves
            # as a STORE's source. Such a region refuses to be a LOAD's target.
            sealed = bool(seals & WRITE_SEALS)
            share = mmap.MAP_PRIVATE if sealed else mmap.MAP_SHARED
            mapping = mmap.mmap(fd, length, share | populate, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # e.g. a GPU dma-buf: only the DOCA engine can import that
            raise DmaError(errno.EOPNOTSUPP, f"cannot map this {kind}: {e.strerror}") from None
        return Region(length, kind, (mapping, memoryview(mapping), not sealed), owner)

    def _register_cuda(self, handle: bytes, offset: int, length: int, owner=None) -> Region:
        if not 0 < length <= MAX_REGION or offset < 0:
            raise DmaError(errno.EINVAL, f"CUDA span {offset}+{length} is out of range")
        from .cuda import context  # only a CUDA region needs cuda-python
        cuda = self._cuda = context(self.cuda_device)
        base, size = cuda.open_ipc(handle)
        if offset + length > size:
            cuda.close_ipc(base)
            raise DmaError(errno.EFAULT, f"span {offset}+{length} is outside the CUDA "
                                         f"allocation of {size} bytes")
        return Region(length, "cuda_ipc", (cuda, base, base + offset), owner)

    def wants_allocated(self, region: Region) -> bool:
        # Ad hoc on an H200 host (bench/gpu_parts.py, docs/benchmarks/gpu-notes.md): a 32 MiB
        # copy into windows with no pages yet took 14.5 ms, against 3.1 ms to allocate and
        # map them (fallocate, 2 MiB pages) plus 2.8 ms to lock and copy.
        return region.kind == "cuda_ipc"

    def prepare_host_memory(self, chunk) -> None:
        """A chunk was mapped ahead of need (blocking: map_ahead's worker thread): once CUDA
        regions are in use, it is page-locked now, so that a copy never pays
        cuMemHostRegister on the request's path."""
        if self._cuda is not None:
            self._cuda.pin_ahead(chunk)

    def locks_host_memory(self) -> bool:
        """Whether store chunks may be page-locked now (once a CUDA region came)."""
        return self._cuda is not None

    def forget_host_memory(self, chunk) -> None:
        """The DRAM pool is about to unmap `chunk`: drop a CUDA page-lock on it, if any."""
        if self._cuda is not None:
            self._cuda.unpin(chunk)

    def release(self, region: Region) -> None:
        if region.kind == "cuda_ipc":
            cuda, base, _ = region.handle
            cuda.close_ipc(base)
            return
        mapping, view, _ = region.handle
        try:
            view.release()
            mapping.close()
        except BufferError:
            # A slice of it outlived its request: a failed disk read's traceback keeps the
            # views it was handed until the garbage collector breaks the exception's cycles
            # (seen: an EIO from btrfs under hit_path direct; this took the daemon down).
            gc.collect()
            try:
                view.release()
                mapping.close()
            except BufferError:
                log.warning("region %d: a view of its memory is still held; it is unmapped "
                            "when that goes", region.id)

    async def to_store(self, region, offset, dst) -> None:
        if region.kind == "cuda_ipc":
            cuda, _, start = region.handle
            await trio.to_thread.run_sync(cuda.device_to_host, start + offset, dst)
            return
        src = region.handle[1]
        pairs = []
        for d in dst:
            pairs.append((d, src[offset:offset + len(d)]))
            offset += len(d)
        await _copy(pairs, into_store=True)

    async def to_new_file(self, region, offset, fd, length) -> bool:
        # pwrite instead of a copy into the chunks' 1 MiB mappings: a mapping that small
        # cannot map a 2 MiB page, so each 4 KiB of a memfd with no pages yet was a page
        # fault (8192 per 32 MiB block). The kernel's write allocates the pages as it copies,
        # 2 MiB ones under the shmem policy, as a POSIX store's passthrough write does. Ad hoc,
        # fresh 32 MiB memfds, 2-core AMD EPYC VM: faults 20.7 ms, fallocate then populated
        # mappings 5.2 ms, pwrite 2.2 ms. Through the mount, 24 ioctl STOREs of 32 MiB in a
        # row, 3 rounds: the ioctl past the spares (tiers.dram.prefault) took 12.1-12.4 ms
        # (medians), now 3.0-3.4; into a spare, through its windows, 2.2-2.5 ms as before.
        if region.kind == "cuda_ipc":
            return False
        region.check_span(offset, length)
        await trio.to_thread.run_sync(_pwrite_all, fd, region.handle[1][offset:offset + length])
        return True

    def host_view(self, region, offset, length):
        if region.kind == "cuda_ipc":
            return None
        _, view, writable = region.handle
        if not writable:
            return None
        region.check_span(offset, length)
        return view[offset:offset + length]

    async def from_store(self, src, region, offset) -> None:
        if region.kind == "cuda_ipc":
            cuda, _, start = region.handle
            await trio.to_thread.run_sync(cuda.host_to_device, src, start + offset)
            return
        _, dst, writable = region.handle
        if not writable:
            raise DmaError(errno.EPERM, "the memfd is sealed against writing: it can be the "
                                        "source of a STORE, not the target of a LOAD")
        pairs = []
        for s in src:
            pairs.append((dst[offset:offset + len(s)], s))
            offset += len(s)
        await _copy(pairs)


# Copies this large go to a worker thread with memmove, which releases the GIL: the event
# loop keeps serving and two copies can run on two cores. Smaller ones (a 1 MiB FUSE request)
# cost less inline than a thread hand-off. From SPLIT_COPY_MIN on (a zero-copy STORE or LOAD
# of a whole block) the chunks are split over two threads: one thread's memmove did ~7.7 GiB/s
# here. Ad hoc, alternating runs of bench/ioctl_bench.py on the 2-core Xeon VM: STORE
# 3,140-3,430 -> 3,890-4,070 MiB/s. LOAD measured lower in those runs (3,290-3,740 ->
# 2,840-3,210), and as low with LOAD kept on one thread: not the split, but (most likely) the
# faster stores leaving more write-behind running into the load phase.
THREAD_COPY_MIN = 4 << 20
SPLIT_COPY_MIN = 16 << 20


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _memmove_pairs(pairs) -> None:
    for dst, src in pairs:
        if len(dst):
            ctypes.memmove(_address(dst), _address(src), len(dst))


def _pwrite_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done:]], done)


def _stream_pairs(pairs) -> None:
    """Copies into the store with streaming stores (native/stream_copy.c says why); the call
    releases the GIL."""
    ffi, lib = _stream_copy.ffi, _stream_copy.lib
    for dst, src in pairs:
        if len(dst):
            lib.bc_stream_copy(ffi.from_buffer(dst), ffi.from_buffer(src), len(dst))


async def _copy(pairs, into_store: bool = False) -> None:
    """Copies into the store stream past the cache; copies out of it (a read, a LOAD) do not:
    hostd's kernel copy or the client reads those bytes next."""
    copy_pairs = _stream_pairs if into_store else _memmove_pairs
    total = sum(len(d) for d, _ in pairs)
    if total >= SPLIT_COPY_MIN and len(pairs) > 1:
        half = len(pairs) // 2
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, copy_pairs, pairs[:half])
            nursery.start_soon(trio.to_thread.run_sync, copy_pairs, pairs[half:])
    elif total >= THREAD_COPY_MIN:
        await trio.to_thread.run_sync(copy_pairs, pairs)
    elif into_store:
        copy_pairs(pairs)
    else:
        for dst, src in pairs:
            dst[:] = src


# -- region registration over a unix socket ------------------------------------------------


log = logging.getLogger("bluecached.dma")
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)


def _received_fds(ancdata) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


async def _serve_connection(conn, table) -> None:
    """One client connection: its regions live until it closes."""
    owner = object()
    try:
        while True:
            data, ancdata, _flags, _addr = await conn.recvmsg(4096, _FD_SPACE)
            fds = _received_fds(ancdata)
            try:
                if not data:
                    return
                reply = _handle(table, owner, data, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            await conn.send(msgpack.packb(reply, use_bin_type=True))
    except OSError as e:
        log.info("region client went away: %s", e)
    finally:
        released = table.remove_owner(owner)
        if released:   # every zero-copy request closes its connection: not worth INFO
            log.debug("released %d regions of a closed client connection", released)
        conn.close()


def _handle(table, owner, data: bytes, fds: list[int]) -> dict:
    try:
        msg = msgpack.unpackb(data, raw=False)
        if type(msg) is not dict:
            raise DmaError(errno.EBADMSG, "region request is not a map")
        op = msg.get("op")
        if op == "register":
            kind = msg.get("kind", "memfd")
            if len(fds) != 1 or type(msg.get("length")) is not int or type(kind) is not str:
                raise DmaError(errno.EINVAL, "register takes one fd, an integer length and a kind")
            region = table.add(table.engine.register((kind, fds[0], msg["length"]), owner))
            return {"ok": True, "region": region.id, "length": region.length}
        if op == "unregister" and type(msg.get("region")) is int:
            table.remove(msg["region"], owner)
            return {"ok": True}
        raise DmaError(errno.EINVAL, f"unknown region request {op!r}")
    except DmaError as e:
        return {"ok": False, "errno": e.errno, "error": e.strerror}
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        return {"ok": False, "errno": errno.EBADMSG, "error": f"undecodable request: {e}"}


async def serve_regions(path: str, table, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accepts region registrations at `path` (only the daemon's user may hand it memory)."""
    await serve_private(path, lambda conn: _serve_connection(conn, table), backlog=64,
                        task_status=task_status)
