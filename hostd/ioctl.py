"""The zero-copy ioctl's transfers: STORE, LOAD and QUERY on files of the mount
(include/bluecache_ioctl.h).

fusefs/ioctl.py takes each request from the kernel and answers it; this is the `Transfers`
behind it. It validates the request struct against the ABI, takes the caller's fd with
pidfd_getfd, registers the memory with the daemon's DMA engine and asks the daemon to move the
bytes. hostd never touches the payload.
"""

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat

import trio

from bluecached.dma import DmaError
from bluecached.wire.client import RemoteError
from fusefs.errors import Refused

from . import ioctl_abi as abi
from .doca_export import DocaSetupError, ExportError, MappedFd
from .region_cache import RegionCache

log = logging.getLogger("hostd.ioctl")

_SYS_PIDFD_GETFD = 438   # the same number on x86_64 and arm64 (asm-generic)
_libc = ctypes.CDLL(None, use_errno=True)
MAX_SPAN = 1 << 62       # offsets and lengths beyond this are nonsense (and overflow-prone)


def take_fd(pid: int, fd: int) -> int:
    """A duplicate of the caller's fd `fd` (pidfd_getfd). The caller can only name its own."""
    if fd < 0:
        raise Refused(errno.EBADF, f"fd {fd} is not a file descriptor")
    try:  # FUSE reports the calling thread; pidfd_open wants its process
        with open(f"/proc/{pid}/status") as f:
            tgid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
        pidfd = os.pidfd_open(tgid)
    except (OSError, StopIteration) as e:
        raise Refused(errno.EPERM, f"cannot reach the calling process {pid}: {e}") from None
    try:
        dup = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            err = ctypes.get_errno()
            raise Refused(err if err == errno.EBADF else errno.EPERM,
                          f"pidfd_getfd({pid}, {fd}): {os.strerror(err)}")
        return dup
    finally:
        os.close(pidfd)


def check_memory(fd: int, kind: int, offset: int, length: int) -> None:
    """The caller's memory must be of the kind it claims and hold the whole span.

    The kind is checked first with calls that never reach a file system (F_GET_SEALS, the fd's
    /proc link): an fd naming a file of this very mount must not make hostd ask itself a
    question (fstat would send GETATTR to the thread that is busy asking)."""
    if kind == abi.MEM_MEMFD:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise Refused(errno.EINVAL, "MEMFD: the fd is not a memfd") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise Refused(errno.EINVAL, "MEMFD: seal it with F_SEAL_SHRINK first")
        st = os.fstat(fd)   # shmem: answered by the kernel
        if not stat.S_ISREG(st.st_mode):
            raise Refused(errno.EINVAL, "MEMFD: the fd is not a regular memfd")
        if offset + length > st.st_size:
            raise Refused(errno.EFAULT, f"span {offset}+{length} is beyond the memfd's "
                                        f"{st.st_size} bytes")
    elif kind == abi.MEM_DMABUF:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("anon_inode:dmabuf"):
            raise Refused(errno.EINVAL, "DMABUF: the fd is not a dma-buf")


def take_memory(pid: int, fd: int, kind: int, offset: int, length: int) -> int:
    """take_fd + check_memory; runs in a worker thread, off the FUSE loop."""
    dup = take_fd(pid, fd)
    try:
        check_memory(dup, kind, offset, length)
    except BaseException:
        os.close(dup)
        raise
    return dup


class ZeroCopyTransfers:
    """fusefs' `Transfers`, over the link to bluecached."""

    commands = frozenset({abi.IOC_STORE, abi.IOC_LOAD, abi.IOC_QUERY})
    changing = frozenset({abi.IOC_STORE})

    def __init__(self, link, kept_regions: int = 16, region_idle: float = 10.0):
        self.link = link
        self.zero_copy_bytes = 0
        self.regions = RegionCache(link, kept_regions, region_idle)

    async def serve(self, cmd: int, fh: int, request: bytes, pid: int) -> bytes:
        try:
            if cmd == abi.IOC_QUERY:
                return await self._query(fh, request)
            return await self._transfer(cmd, fh, request, pid)
        except (Refused, RemoteError):
            raise
        except OSError as e:
            # hostd's own calls failing (the region socket, a mapping): no errno the caller
            # could act on, and a failure fusefs should report as a bug (EIO, logged).
            raise RuntimeError(f"ioctl {cmd:#x}: {e}") from e

    @staticmethod
    def _parse(request: bytes, layout, cls):
        if len(request) != layout.size:
            raise Refused(errno.EINVAL, f"request of {len(request)} bytes, expected "
                                        f"{layout.size}")
        parsed = cls.unpack(request)
        if parsed.version != abi.VERSION:
            raise Refused(errno.EINVAL, f"ABI version {parsed.version}, hostd speaks "
                                        f"{abi.VERSION}")
        if parsed.struct_size != layout.size:
            raise Refused(errno.EINVAL, f"struct_size {parsed.struct_size}, expected "
                                        f"{layout.size}")
        if any(parsed.reserved):
            raise Refused(errno.EINVAL, "reserved bytes must be zero")
        return parsed

    async def _transfer(self, cmd: int, fh: int, request: bytes, pid: int) -> bytes:
        x = self._parse(request, abi.XFER, abi.Xfer)
        store = cmd == abi.IOC_STORE
        if x.flags:
            raise Refused(errno.EINVAL, f"unknown flags {x.flags:#x}")
        if x.mem_kind not in abi.MEM_KINDS:
            raise Refused(errno.EINVAL, f"unknown memory kind {x.mem_kind}")
        if max(x.mem_offset, x.length, x.file_offset) >= MAX_SPAN or \
                x.mem_offset + x.length >= MAX_SPAN:
            raise Refused(errno.EINVAL, "offset or length out of range")
        if store and x.file_offset:
            raise Refused(errno.EINVAL, "STORE replaces the whole content: file_offset 0")
        if x.mem_kind == abi.MEM_CUDA_IPC and not any(x.cuda_ipc_handle):
            raise Refused(errno.EINVAL, "CUDA_IPC with an all-zero handle")
        open_file = self.link.open_file(fh)
        if open_file is None:
            raise Refused(errno.EBADF, "not an open file of this mount")
        writable = (open_file.flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        readable = (open_file.flags & os.O_ACCMODE) in (os.O_RDONLY, os.O_RDWR)
        if store and not writable or not store and not readable:
            raise Refused(errno.EBADF, "the file is not open for " +
                          ("writing" if store else "reading"))
        if x.length == 0:
            moved = 0
            if store:
                await self.link.setattr(open_file.ino, size=0)
            size = (await self.link.getattr(open_file.ino)).size
        elif x.mem_kind == abi.MEM_CUDA_IPC:
            moved, size = await self._move_cuda(store, fh, x)
        else:
            fd = await trio.to_thread.run_sync(take_memory, pid, x.fd, x.mem_kind,
                                               x.mem_offset, x.length)
            try:
                moved, size = await self._move(store, fh, fd, x)
            finally:
                os.close(fd)
        self.zero_copy_bytes += moved
        x.result_length, x.file_size = moved, size
        return x.pack()

    async def _move(self, store: bool, fh: int, fd: int, x) -> tuple[int, int]:
        span = x.mem_offset + x.length
        kind = abi.MEM_KINDS[x.mem_kind]
        if self.link.engine == "doca":
            return await self._move_doca(store, fh, fd, x, kind)
        if self.link.regions_path is None:
            raise Refused(errno.EOPNOTSUPP, "this engine cannot map host memfds")
        # The region stays registered for the next request with this memory (region_cache.py).
        # (bounded: a stopped daemon fails the transfer with EIO, as any request)
        for attempt in (1, 2):
            entry = await self.regions.acquire(fd, span, kind)
            try:
                result = await self._move_region(store, fh, x, entry.id, x.mem_offset)
            except RemoteError as e:
                # Registered with a daemon that restarted before the request reached it: the
                # new one knows no such region (EINVAL, before it moved anything). Once more.
                lost = entry.generation != self.link.generation and e.errno == errno.EINVAL
                with trio.CancelScope(shield=True):
                    await self.regions.release(entry, failed=lost)
                if lost and attempt == 1:
                    continue
                raise
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self.regions.release(entry)
                raise
            await self.regions.release(entry)
            return result
        raise AssertionError("unreachable")

    async def _move_and_release(self, store: bool, fh: int, x, region: int,
                                region_offset: int) -> tuple[int, int]:
        """A transfer through a region imported for this one request, released whatever
        happens (even when this task is cancelled)."""
        try:
            return await self._move_region(store, fh, x, region, region_offset)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.link.call("release_region", region=region)
                except RemoteError as e:   # the daemon went away: the region went with it
                    log.info("release of region %d: %s", region, e)

    async def _move_region(self, store: bool, fh: int, x, region: int,
                           region_offset: int) -> tuple[int, int]:
        if store:
            r = await self.link.call("store", host_fh=fh, length=x.length, region=region,
                                     region_offset=region_offset)
            return r["length"], r["size"]
        r = await self.link.call("read", host_fh=fh, offset=x.file_offset, length=x.length,
                                 region=region, region_offset=region_offset)
        size = r.get("size")   # a daemon older than the reply's size: one more round trip
        if size is None:
            size = (await self.link.getattr(self.link.open_file(fh).ino)).size
        return r["length"], size

    async def _move_cuda(self, store: bool, fh: int, x) -> tuple[int, int]:
        """CUDA device memory: bluecached opens the caller's IPC handle and the GPU copies.
        A handle is a capability: whoever holds its bytes can open the memory with
        cuIpcOpenMemHandle themselves, so passing one grants nothing the caller lacks."""
        if self.link.engine == "doca":
            return await self._move_cuda_doca(store, fh, x)
        r = await self.link.call("import_cuda_ipc", handle=x.cuda_ipc_handle,
                                 offset=x.mem_offset, length=x.length)
        return await self._move_and_release(store, fh, x, r["region"], 0)

    async def _move_cuda_doca(self, store: bool, fh: int, x) -> tuple[int, int]:
        """GPU memory to the DPU: hostd opens the caller's IPC handle and exports the device
        memory to DOCA as a dma-buf (cuMemGetHandleForAddressRange); where the driver gives
        none, as a memrange over the device address, which DOCA can register only with
        nvidia-peermem loaded. Neither is proven on hardware (docs/hardware.md); where both
        fail the caller gets EOPNOTSUPP and copies into a SharedBuffer first."""
        try:
            from bluecached.dma.cuda import context
            cuda = await trio.to_thread.run_sync(context)
            base, size = await trio.to_thread.run_sync(cuda.open_ipc, x.cuda_ipc_handle)
        except DmaError as e:
            raise Refused(e.errno, e.strerror) from None
        try:
            if x.mem_offset + x.length > size:
                raise Refused(errno.EFAULT, f"span {x.mem_offset}+{x.length} is outside "
                                            f"the CUDA allocation of {size} bytes")
            try:
                exporter = self.link.doca_exporter()
                export, region_offset, dmabuf = await trio.to_thread.run_sync(
                    _export_device_memory, cuda, exporter, base + x.mem_offset, x.length,
                    not store)
            except (ExportError, DocaSetupError) as e:
                raise Refused(errno.EOPNOTSUPP, f"GPU memory cannot be exported to the "
                                                f"DPU here: {e}") from None
            try:
                r = await self.link.call("import_region", descriptor=export.descriptor,
                                         address=export.address, length=export.length)
                return await self._move_and_release(store, fh, x, r["region"], region_offset)
            finally:
                exporter.unexport(export)
                if dmabuf is not None:
                    os.close(dmabuf)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(cuda.close_ipc, base)

    async def _move_doca(self, store: bool, fh: int, fd: int, x, kind: str) -> tuple[int, int]:
        """The doca engine: the caller's memory is exported to the DPU for this one transfer,
        read-only for a STORE. Only the DPU touches the bytes."""
        try:
            exporter = self.link.doca_exporter()
            if kind == "dmabuf":
                mapped = None
                export = exporter.export_dmabuf(fd, x.mem_offset, x.length, writable=not store)
            else:
                mapped = MappedFd(fd, x.mem_offset + x.length)
                if not store and not mapped.writable:
                    mapped.close()
                    raise Refused(errno.EPERM, "the memfd is sealed against writing: it can "
                                               "be the source of a STORE, not the target "
                                               "of a LOAD")
                try:
                    export = exporter.export(mapped.address + x.mem_offset, x.length,
                                             writable=not store)
                except BaseException:
                    mapped.close()
                    raise
        except (ExportError, DocaSetupError) as e:
            raise Refused(getattr(e, "errno", None) or errno.EOPNOTSUPP,
                          getattr(e, "strerror", None) or str(e)) from None
        try:
            r = await self.link.call("import_region", descriptor=export.descriptor,
                                     address=export.address, length=export.length)
            return await self._move_and_release(store, fh, x, r["region"], 0)
        finally:
            exporter.unexport(export)
            if mapped is not None:
                mapped.close()

    async def _query(self, fh: int, request: bytes) -> bytes:
        q = self._parse(request, abi.QUERY, abi.Query)
        r = await self.link.call("query", host_fh=fh)
        tiers = r["tier"].split("+")
        q.file_size, q.crc32c = r["size"], r["crc32c"]
        q.tiers = (abi.TIER_DRAM if "dram" in tiers else 0) | \
                  (abi.TIER_NVME if "nvme" in tiers else 0)
        q.hostd_bytes_copied, q.zero_copy_bytes = self.link.bytes_copied, self.zero_copy_bytes
        return q.pack()


HOST_PAGE = mmap.PAGESIZE


def _export_device_memory(cuda, exporter, address: int, length: int, writable: bool):
    """(export, offset of `address` in it, dma-buf fd to close after unexport or None)."""
    start = address - address % HOST_PAGE             # dma-bufs cover whole host pages
    end = -(-(address + length) // HOST_PAGE) * HOST_PAGE
    try:
        fd = cuda.dmabuf_fd(start, end - start)
    except DmaError as e:
        log.info("no dma-buf for GPU memory (%s): exporting the device range (peermem)", e)
    else:
        try:
            return exporter.export_dmabuf(fd, 0, end - start, writable), address - start, fd
        except ExportError as e:
            os.close(fd)
            log.info("DOCA refused the GPU dma-buf (%s): exporting the device range "
                     "(peermem)", e)
    return exporter.export(address, length, writable), 0, None
