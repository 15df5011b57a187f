"""CUDA device memory for the loopback engine (embedded mode).

A client's device allocation arrives as a CUDA IPC handle; bluecached opens it in its own
context and the GPU's copy engines move the bytes between it and the store's chunks
(cuMemcpyDtoHAsync / cuMemcpyHtoDAsync). Chunks are page-locked (cuMemHostRegister) the first
time a copy touches them and stay so while the DRAM pool keeps them: a copy from pageable memory
would be staged by the driver through its own pinned buffer, a CPU copy this path exists to
avoid.

Written against cuda-python's driver bindings (`cuda.bindings.driver`, 12.x and 13.x; the
older `cuda.cuda` module name is accepted). Every call here runs in a worker thread: they block.

Hardware honesty: written without a GPU; the tests marked `gpu` and bench/gpu_bench.py and
gpu_parts.py have since run on a lent machine with an NVIDIA H200 (docs/benchmarks/gpu-notes.md
records each run).
"""

import ctypes
import errno
import logging
import threading
import time

from .engine import DmaError

log = logging.getLogger("bluecached.dma.cuda")

IPC_HANDLE_SIZE = 64


class CudaUnavailable(DmaError):
    """No cuda-python, no driver or no device: CUDA regions cannot be served here."""

    def __init__(self, message: str):
        super().__init__(errno.EOPNOTSUPP, message)


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise CudaUnavailable("CUDA regions need cuda-python in bluecached's Python "
                                  "(pip install cuda-python)") from None
    return driver


_contexts: dict[int, "CudaContext"] = {}
_contexts_lock = threading.Lock()


def context(ordinal: int = 0) -> "CudaContext":
    """The process's context on device `ordinal`, made on first use (blocks: a worker thread;
    raises CudaUnavailable where CUDA cannot be used)."""
    with _contexts_lock:
        if ordinal not in _contexts:
            _contexts[ordinal] = CudaContext(ordinal)
        return _contexts[ordinal]


def _address(buffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class CudaContext:
    """The primary context of one device, made current in whichever worker thread calls."""

    def __init__(self, ordinal: int = 0):
        self.cu = _driver()
        self.ordinal = ordinal
        try:
            self._check(self.cu.cuInit(0), "cuInit")
        except DmaError:
            raise
        except Exception as e:  # cuda-python raises when libcuda.so.1 is not there at all
            raise CudaUnavailable(f"CUDA driver not usable: {e}") from None
        count = self._check(self.cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise CudaUnavailable(f"CUDA device {ordinal} does not exist ({count} found)")
        self.device = self._check(self.cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = self._check(self.cu.cuDevicePrimaryCtxRetain(self.device),
                                   "cuDevicePrimaryCtxRetain")
        self._pinned: set[int] = set()
        self._pin_failed = False
        self._pin_lock = threading.Lock()
        self._streams: list = []          # idle streams (_take_stream)
        self._streams_lock = threading.Lock()

    def _check(self, result, what: str):
        """cuda-python returns (CUresult, values...): the values, or DmaError naming the call."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            _, name = self.cu.cuGetErrorName(err)
            _, text = self.cu.cuGetErrorString(err)
            name = name.decode() if isinstance(name, bytes) else str(name)
            text = text.decode() if isinstance(text, bytes) else str(text)
            code = errno.EINVAL if "INVALID" in name else errno.EIO
            raise DmaError(code, f"{what}: {name} ({text})")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _current(self) -> None:
        self._check(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    # -- IPC handles (run in a worker thread) --------------------------------------------------

    def open_ipc(self, handle: bytes) -> tuple[int, int]:
        """Opens a peer's allocation: (device address, allocation size)."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise DmaError(errno.EINVAL, f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, "
                                         f"not {len(handle)}")
        self._current()
        h = self.cu.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
        flags = self.cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        try:
            dptr = self._check(self.cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle")
        except DmaError as e:  # the handle is the client's input: whatever the driver says
            raise DmaError(errno.EINVAL, f"not an open CUDA allocation: {e.strerror}") from None
        try:
            base, size = self._check(self.cu.cuMemGetAddressRange(dptr), "cuMemGetAddressRange")
        except BaseException:
            self.cu.cuIpcCloseMemHandle(dptr)
            raise
        return int(base), int(size)

    def dmabuf_fd(self, address: int, length: int) -> int:
        """A dma-buf fd for device memory [address, address + length) (host-page aligned): how
        a NIC or a DPU reaches GPU memory. The caller closes it."""
        self._current()
        kind = self.cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        return int(self._check(self.cu.cuMemGetHandleForAddressRange(
            self.cu.CUdeviceptr(address), length, kind, 0), "cuMemGetHandleForAddressRange"))

    def close_ipc(self, address: int) -> None:
        self._current()
        self._check(self.cu.cuIpcCloseMemHandle(self.cu.CUdeviceptr(address)),
                    "cuIpcCloseMemHandle")

    # -- copies (run in a worker thread) -------------------------------------------------------

    def _pin(self, buf) -> None:
        """Page-locks the whole chunk a view belongs to (registrations must not overlap, and
        the next copy may use another part of it). A failure (RLIMIT_MEMLOCK) only costs speed:
        the driver stages pageable memory itself."""
        owner = buf.obj if isinstance(buf, memoryview) else buf
        address = _address(owner)
        with self._pin_lock:
            if address in self._pinned or self._pin_failed:
                return
            try:
                self._check(self.cu.cuMemHostRegister(address, len(owner),
                                                      self.cu.CU_MEMHOSTREGISTER_PORTABLE),
                            "cuMemHostRegister")
            except DmaError as e:
                self._pin_failed = True
                log.warning("store chunks cannot be page-locked (%s): CUDA copies go through "
                            "the driver's staging buffer, slower", e)
                return
            self._pinned.add(address)

    def pin_ahead(self, chunk) -> None:
        """Page-locks a store chunk before any copy needs it (a worker thread's job)."""
        self._current()
        self._pin(chunk)

    def unpin(self, chunk) -> None:
        """Called before the DRAM pool unmaps a chunk that a copy may have pinned."""
        address = _address(chunk)
        with self._pin_lock:
            if address in self._pinned:
                self._pinned.discard(address)
                self._current()
                self.cu.cuMemHostUnregister(address)

    def device_to_host(self, device_address: int, buffers) -> None:
        self._copy(device_address, buffers, to_host=True)

    def host_to_device(self, buffers, device_address: int) -> None:
        self._copy(device_address, buffers, to_host=False)

    def _take_stream(self):
        """A stream for one copy: from the pool, or a new one (as many as copies ever ran at
        once; a stream per worker thread would leak, trio's threads come and go)."""
        with self._streams_lock:
            if self._streams:
                return self._streams.pop()
        return self._check(self.cu.cuStreamCreate(
            self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def _give_stream(self, stream) -> None:
        with self._streams_lock:
            self._streams.append(stream)

    def _copy(self, device_address: int, buffers, to_host: bool) -> None:
        """Device memory from `device_address` on, to or from the store buffers in order.

        A block is 32 one-MiB chunks: each is queued on one stream and the thread waits
        once, so the copy engine runs them back to back: 32 page-locked windows took 717 us
        on an H200 host, one cuMemcpyDtoH of the same 32 MiB into cuMemAllocHost memory 622
        (bench/gpu_parts.py, docs/benchmarks/gpu-notes.md)."""
        started = time.perf_counter()
        start = device_address
        self._current()
        stream = self._take_stream()
        locked = len(self._pinned)
        try:
            for buf in buffers:
                if not len(buf):
                    continue
                self._pin(buf)
                host, device = _address(buf), self.cu.CUdeviceptr(device_address)
                if to_host:
                    self._check(self.cu.cuMemcpyDtoHAsync(host, device, len(buf), stream),
                                "cuMemcpyDtoHAsync")
                else:
                    self._check(self.cu.cuMemcpyHtoDAsync(device, host, len(buf), stream),
                                "cuMemcpyHtoDAsync")
                device_address += len(buf)
        except BaseException:
            # the copies queued before the failure must end before the caller lets go of
            # the store buffers
            self.cu.cuStreamSynchronize(stream)
            self._give_stream(stream)
            raise
        try:
            self._check(self.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        finally:
            self._give_stream(stream)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s of %d bytes in %.3f ms (%d windows page-locked on the way)",
                      "DtoH" if to_host else "HtoD", device_address - start,
                      (time.perf_counter() - started) * 1e3, len(self._pinned) - locked)
