"""The zero-copy ioctl with CUDA device memory: the client hands over a CUDA IPC handle,
bluecached opens it and the GPU's copy engines move the bytes; hostd copies nothing.

Marked `gpu`. They run on a real GPU where there is one, else on the CUDA driver simulator
(conftest.py): that proves the calls, the context handling in worker threads, the handle
passing between processes and the error paths, not what a GPU does with them. Device memory
is allocated with cuda-python itself (cuMemAlloc), so neither torch nor cupy is needed.
"""

import errno
import fcntl
import os
import threading

import pytest

from hostd import ioctl_abi as abi
from hostd.zerocopy import UnsupportedMemory, _handle_bytes, load_into, query, store_from
from support import MiB, pattern

pytestmark = pytest.mark.gpu


def _ok(cu, result):
    err, *values = result
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return values[0] if len(values) == 1 else values


class DeviceBuffer:
    """cuMemAlloc'd memory exposing __cuda_array_interface__ (as torch and cupy do)."""

    def __init__(self, cu, size: int, offset: int = 0, length: int | None = None):
        self.cu, self.size = cu, size
        self.base = int(_ok(cu, cu.cuMemAlloc(size)))
        self.ptr = self.base + offset
        self.length = size - offset if length is None else length
        self.stream = None     # as torch names its current stream (v3): the consumer waits

    @property
    def __cuda_array_interface__(self):
        cai = {"shape": (self.length,), "typestr": "|u1", "data": (self.ptr, False),
               "version": 3, "strides": None}
        if self.stream is not None:
            cai["stream"] = self.stream
        return cai

    def write(self, data: bytes) -> None:
        self.cu.cuCtxSynchronize()
        _ok(self.cu, self.cu.cuMemcpyHtoD(self.cu.CUdeviceptr(self.ptr), data, len(data)))

    def read(self) -> bytes:
        out = bytearray(self.length)
        _ok(self.cu, self.cu.cuMemcpyDtoH(out, self.cu.CUdeviceptr(self.ptr), self.length))
        return bytes(out)

    def free(self) -> None:
        _ok(self.cu, self.cu.cuMemFree(self.cu.CUdeviceptr(self.base)))


def test_store_and_load_device_memory_byte_exact_with_no_copy_by_hostd(cu, mounted):
    s = mounted()
    path = str(s.mnt / "gpu.bin")
    data = pattern("gpu", 32 * MiB)
    src, dst = DeviceBuffer(cu, 32 * MiB), DeviceBuffer(cu, 32 * MiB)
    try:
        src.write(data)
        with open(s.mnt / "warm", "wb") as f:  # the counters of a fresh mount
            f.write(b"x")
        before = query(str(s.mnt / "warm"))
        assert store_from(path, src) == 32 * MiB
        dst.write(bytes(32 * MiB))
        assert load_into(path, dst) == 32 * MiB
        after = query(path)
        assert after["hostd_bytes_copied"] == before["hostd_bytes_copied"]   # zero copy
        assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == 64 * MiB
        assert dst.read() == data
        with open(path, "rb") as f:                       # the POSIX path sees the same bytes
            assert f.read() == data
    finally:
        src.free()
        dst.free()


def test_a_tensor_inside_a_larger_allocation(cu, mounted):
    s = mounted()
    path = str(s.mnt / "inner.bin")
    whole = DeviceBuffer(cu, 8 * MiB)
    try:
        data = pattern("inner", 8 * MiB)
        whole.write(data)
        inner = DeviceBuffer.__new__(DeviceBuffer)
        inner.cu, inner.base, inner.ptr, inner.length = cu, whole.base, whole.base + 3 * MiB, MiB
        inner.stream = None
        assert store_from(path, inner) == MiB
        with open(path, "rb") as f:
            assert f.read() == data[3 * MiB:4 * MiB]
        assert load_into(path, inner, offset=0) == MiB
    finally:
        whole.free()


def test_concurrent_device_stores(cu, mounted):
    s = mounted()
    bufs = [DeviceBuffer(cu, 4 * MiB) for _ in range(8)]
    errors = []

    def work(i):
        try:
            cu.cuCtxSetCurrent(_ok(cu, cu.cuDevicePrimaryCtxRetain(_ok(cu, cu.cuDeviceGet(0)))))
            bufs[i].write(pattern(f"c{i}", 4 * MiB))
            store_from(str(s.mnt / f"c{i}.bin"), bufs[i])
        except Exception as e:  # reported below, with the thread's index
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        for i in range(8):
            with open(s.mnt / f"c{i}.bin", "rb") as f:
                assert f.read() == pattern(f"c{i}", 4 * MiB)
    finally:
        for b in bufs:
            b.free()


def test_a_thread_that_never_used_cuda_stores_and_loads(cu, mounted):
    """A connector's I/O thread has no current context: the client makes the tensor's own
    current for its calls and leaves every thread's context as it found it."""
    s = mounted()
    path = str(s.mnt / "io-thread.bin")
    data = pattern("io-thread", 4 * MiB)
    src, dst = DeviceBuffer(cu, 4 * MiB), DeviceBuffer(cu, 4 * MiB)
    outcome = {}

    def io_thread():
        try:
            outcome["stored"] = store_from(path, src)
            outcome["loaded"] = load_into(path, dst)
            outcome["context after"] = int(_ok(cu, cu.cuCtxGetCurrent()))
        except Exception as e:  # asserted on below, in the test's thread
            outcome["error"] = e

    try:
        src.write(data)
        dst.write(bytes(4 * MiB))
        t = threading.Thread(target=io_thread)
        t.start()
        t.join()
        assert "error" not in outcome, outcome
        assert outcome == {"stored": 4 * MiB, "loaded": 4 * MiB, "context after": 0}
        assert dst.read() == data
        mine = int(_ok(cu, cu.cuCtxGetCurrent()))
        assert store_from(path, src) == 4 * MiB
        assert int(_ok(cu, cu.cuCtxGetCurrent())) == mine != 0
    finally:
        src.free()
        dst.free()


def test_handle_of_freed_memory_is_refused_and_nothing_is_stored(cu, mounted):
    s = mounted(allow_log=("cuIpcOpenMemHandle",))
    buf = DeviceBuffer(cu, 2 * MiB)
    handle = _handle_bytes(_ok(cu, cu.cuIpcGetMemHandle(cu.CUdeviceptr(buf.base))))
    buf.free()
    path = s.mnt / "freed.bin"
    path.write_bytes(b"old content")
    x = abi.Xfer(mem_kind=abi.MEM_CUDA_IPC, mem_offset=0, length=2 * MiB,
                 cuda_ipc_handle=handle)
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(fd, abi.IOC_STORE, bytearray(x.pack()), True)
        assert e.value.errno in (errno.EINVAL, errno.EFAULT, errno.EIO)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"old content"
    # the daemon keeps serving device memory
    ok = DeviceBuffer(cu, MiB)
    try:
        ok.write(pattern("after", MiB))
        assert store_from(str(s.mnt / "after.bin"), ok) == MiB
    finally:
        ok.free()


def test_handle_bytes_layout_matches_the_abi(cu):
    buf = DeviceBuffer(cu, MiB)
    try:
        h = _ok(cu, cu.cuIpcGetMemHandle(cu.CUdeviceptr(buf.base)))
        raw = _handle_bytes(h)
        assert len(raw) == 64 and raw != bytes(64)
        # the bytes survive the round trip through the ioctl struct
        assert abi.Xfer.unpack(abi.Xfer(cuda_ipc_handle=raw).pack()).cuda_ipc_handle == raw
    finally:
        buf.free()


def _store_raw(path, x) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        fcntl.ioctl(fd, abi.IOC_STORE, bytearray(x.pack()), True)
    finally:
        os.close(fd)


def test_span_beyond_the_allocation_is_refused_and_nothing_is_stored(cu, mounted):
    s = mounted(allow_log=("outside the CUDA",))
    buf = DeviceBuffer(cu, MiB)
    path = s.mnt / "span.bin"
    path.write_bytes(b"old content")
    try:
        handle = _handle_bytes(_ok(cu, cu.cuIpcGetMemHandle(cu.CUdeviceptr(buf.base))))
        for offset, length in ((0, MiB + 1), (MiB - 4096, 8192), (MiB, 1)):
            x = abi.Xfer(mem_kind=abi.MEM_CUDA_IPC, mem_offset=offset, length=length,
                         cuda_ipc_handle=handle)
            with pytest.raises(OSError) as e:
                _store_raw(path, x)
            assert e.value.errno == errno.EFAULT, (offset, length)
        assert path.read_bytes() == b"old content"
    finally:
        buf.free()


def test_handle_of_a_process_that_exited_is_refused(cu, cuda_kind, mounted, tmp_path):
    """The exporting process is gone, so is its memory: an IPC handle it made opens nothing."""
    import subprocess
    import sys
    s = mounted(allow_log=("cuIpcOpenMemHandle",))
    script = ("from cuda.bindings import driver as d\n"
              "d.cuInit(0); _, dev = d.cuDeviceGet(0)\n"
              "_, ctx = d.cuDevicePrimaryCtxRetain(dev); d.cuCtxSetCurrent(ctx)\n"
              "_, p = d.cuMemAlloc(1 << 20); _, h = d.cuIpcGetMemHandle(p)\n"
              "import ctypes, sys\n"
              "sys.stdout.write(ctypes.string_at(h.getPtr(), 64).hex())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    handle = bytes.fromhex(out)
    assert len(handle) == 64 and any(handle)
    path = s.mnt / "orphan.bin"
    path.write_bytes(b"old content")
    with pytest.raises(OSError) as e:
        _store_raw(path, abi.Xfer(mem_kind=abi.MEM_CUDA_IPC, length=MiB,
                                  cuda_ipc_handle=handle))
    assert e.value.errno in (errno.EINVAL, errno.EFAULT, errno.EIO)
    assert path.read_bytes() == b"old content"


def test_device_stores_and_posix_reads_mixed_on_one_file(cu, mounted):
    """Readers of a file being replaced by device STOREs see a whole old or whole new content;
    a POSIX write is then what a device LOAD returns."""
    s = mounted()
    path = s.mnt / "mixed.bin"
    versions = [pattern(f"v{i}", 4 * MiB) for i in range(6)]
    path.write_bytes(versions[0])
    src = DeviceBuffer(cu, 4 * MiB)
    seen, stop, errors = set(), threading.Event(), []

    def read_loop():
        try:
            while not stop.is_set():
                with open(path, "rb") as f:
                    content = f.read()
                seen.add(versions.index(content))   # ValueError: a torn or mixed content
        except Exception as e:  # reported below
            errors.append(e)

    # Four readers: enough that one is often answered without a backing (the STORE's
    # object not complete yet) while another gets one (fusefs/passthrough.py)
    readers = [threading.Thread(target=read_loop) for _ in range(4)]
    try:
        for t in readers:
            t.start()
        for v in versions[1:]:
            src.write(v)
            assert store_from(str(path), src) == 4 * MiB
        stop.set()
        for t in readers:
            t.join()
        assert not errors, errors
        assert seen <= set(range(6)) and seen
        assert path.read_bytes() == versions[-1]
        posix = pattern("posix", 4 * MiB)
        with open(path, "r+b") as f:
            f.write(posix)
        dst = DeviceBuffer(cu, 4 * MiB)
        try:
            assert load_into(str(path), dst) == 4 * MiB
            assert dst.read() == posix
        finally:
            dst.free()
    finally:
        stop.set()
        src.free()


def test_the_tensors_stream_is_waited_for_before_store_and_load(cu, mounted):
    """Work still queued on the stream __cuda_array_interface__ names (a producer's copy into
    the block; a copy into a LOAD's target) ends before the cache touches the memory: the
    STORE holds the produced bytes, the LOAD's bytes are not overwritten afterwards. (On the
    simulator queued copies wait for a synchronise, so the missing wait shows every time.)"""
    s = mounted()
    stream = _ok(cu, cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    buf = DeviceBuffer(cu, 2 * MiB)
    buf.stream = int(stream)
    produced, stale, stored = (pattern(n, 2 * MiB) for n in ("produced", "stale", "stored"))
    try:
        buf.write(bytes(2 * MiB))
        _ok(cu, cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(buf.ptr), produced, 2 * MiB, stream))
        assert store_from(str(s.mnt / "produced.bin"), buf) == 2 * MiB
        assert (s.mnt / "produced.bin").read_bytes() == produced

        (s.mnt / "stored.bin").write_bytes(stored)
        _ok(cu, cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(buf.ptr), stale, 2 * MiB, stream))
        assert load_into(str(s.mnt / "stored.bin"), buf) == 2 * MiB
        _ok(cu, cu.cuStreamSynchronize(stream))
        assert buf.read() == stored
    finally:
        buf.free()
        cu.cuStreamDestroy(stream)


@pytest.mark.parametrize("stream", [0, True, "1"])
def test_a_stream_that_is_not_one_is_refused_in_the_caller(cu, mounted, stream):
    s = mounted()
    buf = DeviceBuffer(cu, MiB)
    buf.stream = stream
    try:
        with pytest.raises(UnsupportedMemory, match="stream"):
            store_from(str(s.mnt / "x.bin"), buf)
        assert not (s.mnt / "x.bin").exists()
    finally:
        buf.free()


@pytest.mark.parametrize("pages", ["4KiB", "2MiB"])
def test_a_load_after_a_truncation_and_a_regrow_moves_the_new_bytes(cu, mounted, pages,
                                                                       request):
    """A CUDA copy page-locks the chunks it touches, and the GPU keeps the pages it locked.
    A truncation cuts the memfd's pages past the new end, and a write that grows the file
    again gets new pages. A LOAD must then move those, not the locked old ones. (On 2 MiB
    pages the kernel zeroes a locked page it cannot split in place instead; on the
    simulator, which locks nothing, this passes either way.)"""
    if pages == "4KiB":
        request.getfixturevalue("shmem_never")
    _truncate_regrow_load(cu, mounted(**{"tiers.dram.huge_pages": pages == "2MiB"}))


def _truncate_regrow_load(cu, s) -> None:
    path = s.mnt / "cut.bin"
    old = pattern("old", 2 * MiB)
    src, dst = DeviceBuffer(cu, 2 * MiB), DeviceBuffer(cu, 2 * MiB)
    try:
        src.write(old)
        assert store_from(str(path), src) == 2 * MiB
        dst.write(bytes(2 * MiB))
        assert load_into(str(path), dst) == 2 * MiB and dst.read() == old
        cut = 3 * MiB // 2
        os.truncate(path, cut)
        tail = pattern("new", 2 * MiB - cut)
        with open(path, "r+b") as f:
            f.seek(cut)
            f.write(tail)
        assert path.read_bytes() == old[:cut] + tail
        dst.write(bytes(2 * MiB))
        assert load_into(str(path), dst) == 2 * MiB
        assert dst.read() == old[:cut] + tail
    finally:
        src.free()
        dst.free()
