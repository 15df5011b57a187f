"""The zero-copy ioctl with CUDA device memory: the client hands over a CUDA IPC handle,
bluecached opens it and the GPU's copy engines move the bytes; hostd copies nothing.

Marked `gpu`: skipped where cuda-python, a driver or a device is missing. Device memory is
allocated with cuda-python itself (cuMemAlloc), so neither torch nor cupy is needed.
"""

import errno
import fcntl
import os
import threading

import pytest

from hostd import ioctl_abi as abi
from hostd.zerocopy import _handle_bytes, load_into, query, store_from
from support import MiB, pattern

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cu():
    try:
        from cuda.bindings import driver
    except ImportError:
        pytest.skip("cuda-python is not installed")
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # no libcuda.so.1
        pytest.skip(f"no CUDA driver: {e}")
    if err != driver.CUresult.CUDA_SUCCESS:
        pytest.skip(f"cuInit: {err}")
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        pytest.skip("no CUDA device")
    _, dev = driver.cuDeviceGet(0)
    _, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    driver.cuCtxSetCurrent(ctx)
    return driver


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

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.length,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None}

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
