"""Python client of the zero-copy ioctl: store a buffer as a file of the mount, load a file
into a buffer, with no copy by hostd.

    buf = SharedBuffer(32 << 20)            # memfd-backed host memory
    arr = buf.array("uint16")               # a numpy view of it, if numpy is installed
    store_from("/mnt/kv-cache/m/abc.bin", buf)
    load_into("/mnt/kv-cache/m/abc.bin", buf)

Memory the daemon can reach: a SharedBuffer (or any view into one: numpy arrays, memoryviews),
or CUDA device memory (objects with __cuda_array_interface__, e.g. torch or cupy tensors; the
IPC handle is made here, in the caller's process). Anything else raises UnsupportedMemory:
ordinary process memory cannot be handed over without a copy.
"""

import contextlib
import ctypes
import fcntl
import os
import threading

from bluecached.shm import SharedRegion

from . import ioctl_abi as abi


class UnsupportedMemory(TypeError):
    pass


_registry_lock = threading.Lock()
_registry: dict[int, "SharedBuffer"] = {}   # base address -> buffer


class SharedBuffer:
    """Host memory in a sealed memfd: shareable with the cache daemon."""

    def __init__(self, size: int, name: str = "bluecache-buffer"):
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self._region = SharedRegion(size, name)   # the same sealed memfd hostd stages in
        self.fd, self.map = self._region.fd, self._region.map
        self.address = _address_of(self.map)
        with _registry_lock:
            _registry[self.address] = self

    def __buffer__(self, flags):  # Python 3.12+: usable wherever a buffer is
        return memoryview(self.map)

    def view(self) -> memoryview:
        return memoryview(self.map)

    def array(self, dtype="uint8", shape=None):
        import numpy
        arr = numpy.frombuffer(self.map, dtype=dtype)
        return arr.reshape(shape) if shape is not None else arr

    def close(self) -> None:
        with _registry_lock:
            _registry.pop(self.address, None)
        self._region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _address_of(buffer) -> int:
    view = memoryview(buffer)
    if view.readonly:
        raise UnsupportedMemory("read-only memory cannot come from a SharedBuffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


def _describe(buffer) -> abi.Xfer:
    """Which memory `buffer` is, as the ioctl names it."""
    if isinstance(buffer, SharedBuffer):
        return abi.Xfer(mem_kind=abi.MEM_MEMFD, fd=buffer.fd, mem_offset=0, length=buffer.size)
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if cai is not None:
        return _describe_cuda(cai)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise UnsupportedMemory(f"{type(buffer).__name__} is not a buffer") from None
    if not view.c_contiguous:
        raise UnsupportedMemory("the buffer must be contiguous")
    address, length = _address_of(view), view.nbytes
    with _registry_lock:
        for base, shared in _registry.items():
            if base <= address and address + length <= base + shared.size:
                return abi.Xfer(mem_kind=abi.MEM_MEMFD, fd=shared.fd,
                                mem_offset=address - base, length=length)
    raise UnsupportedMemory(
        "this memory cannot be handed to the cache without a copy: allocate it with "
        "hostd.zerocopy.SharedBuffer (host) or on a CUDA device")


def _describe_cuda(cai: dict) -> abi.Xfer:
    if cai.get("strides") not in (None, ()):
        raise UnsupportedMemory("CUDA memory must be contiguous")
    driver = _cuda_driver()
    ptr = int(cai["data"][0])
    length = int(cai["typestr"][2:])
    for dim in cai["shape"]:
        length *= dim
    if ptr == 0 or length == 0:
        raise UnsupportedMemory("empty CUDA memory")
    with _context_of(driver, ptr):
        # The handle names the whole allocation; the offset says where in it the tensor starts.
        base, _size = _cuda_call(driver, driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr)),
                                 "cuMemGetAddressRange")
        handle = _cuda_call(driver, driver.cuIpcGetMemHandle(base),
                            "cuIpcGetMemHandle (IPC needs memory from cudaMalloc/cuMemAlloc; "
                            "not cudaMallocAsync pools or PyTorch expandable segments)")
        _wait_for_stream(driver, cai.get("stream"))
    return abi.Xfer(mem_kind=abi.MEM_CUDA_IPC, mem_offset=ptr - int(base), length=length,
                    cuda_ipc_handle=_handle_bytes(handle))


@contextlib.contextmanager
def _context_of(driver, ptr: int):
    """Makes the context that owns device pointer `ptr` current in this thread, for the calls
    inside, and restores the thread's own afterwards. A connector's I/O thread has often never
    touched CUDA (torch and cupy make a context current only in threads that use them), and
    cuMemGetAddressRange, cuIpcGetMemHandle and cuStreamSynchronize fail there with
    CUDA_ERROR_INVALID_CONTEXT. cuPointerGetAttribute needs no current context."""
    _cuda_call(driver, driver.cuInit(0), "cuInit")
    owner = _cuda_call(driver, driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, driver.CUdeviceptr(ptr)),
        "cuPointerGetAttribute (not CUDA device memory?)")
    if not int(owner):
        raise UnsupportedMemory("this CUDA memory belongs to no context (cuMemCreate/VMM "
                                "memory): the IPC path needs memory from cudaMalloc/cuMemAlloc")
    _cuda_call(driver, driver.cuCtxPushCurrent(owner), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _cuda_call(driver, driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _wait_for_stream(driver, stream) -> None:
    """__cuda_array_interface__ v3: a consumer must order itself after the producer's stream.
    The cache copies in another process, on streams of its own, so the work queued on the
    tensor's stream (the kernels writing a block to STORE, or still reading a LOAD's target)
    must be done before the ioctl: wait for it here. None: the producer needs no ordering."""
    if stream is None:
        return
    if isinstance(stream, bool) or not isinstance(stream, int) or stream == 0:
        # v3 forbids 0 (ambiguous: 1 is the legacy default stream, 2 the per-thread one)
        raise UnsupportedMemory(f"__cuda_array_interface__ stream {stream!r} is not a stream")
    _cuda_call(driver, driver.cuStreamSynchronize(driver.CUstream(stream)),
               "cuStreamSynchronize (the stream named by __cuda_array_interface__)")


def _cuda_driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise UnsupportedMemory("CUDA memory needs cuda-python (pip install "
                                    "cuda-python)") from None
    return driver


def _cuda_call(driver, result, what: str):
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise UnsupportedMemory(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


def _handle_bytes(handle) -> bytes:
    """The 64 opaque bytes of a CUipcMemHandle (cuda-python 13 no longer exposes `reserved`)."""
    reserved = getattr(handle, "reserved", None)
    if reserved is not None:
        return bytes(reserved)
    return ctypes.string_at(handle.getPtr(), 64)


def _ioctl(fd: int, cmd: int, request: bytes) -> bytes:
    buf = bytearray(request)
    fcntl.ioctl(fd, cmd, buf, True)
    return bytes(buf)


def store_from(path: str, buffer, tmp_suffix: str = ".bctmp") -> int:
    """Makes `buffer` the content of `path`, published atomically (written under a temporary
    name, then renamed). Returns the bytes stored."""
    x = _describe(buffer)
    tmp = f"{path}{tmp_suffix}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        out = abi.Xfer.unpack(_ioctl(fd, abi.IOC_STORE, x.pack()))
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    return out.result_length


def load_into(path: str, buffer, offset: int = 0) -> int:
    """Reads `path` from `offset` into `buffer` (at most its size). Returns the bytes loaded."""
    x = _describe(buffer)
    x.file_offset = offset
    fd = os.open(path, os.O_RDONLY)
    try:
        return abi.Xfer.unpack(_ioctl(fd, abi.IOC_LOAD, x.pack())).result_length
    finally:
        os.close(fd)


def query(path: str) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        q = abi.Query.unpack(_ioctl(fd, abi.IOC_QUERY, abi.Query().pack()))
    finally:
        os.close(fd)
    return {"size": q.file_size, "crc32c": q.crc32c,
            "dram": bool(q.tiers & abi.TIER_DRAM), "nvme": bool(q.tiers & abi.TIER_NVME),
            "hostd_bytes_copied": q.hostd_bytes_copied, "zero_copy_bytes": q.zero_copy_bytes}
