"""The zero-copy ioctl on a real mount: byte-exact, concurrent, mixed with POSIX I/O, no copy by
hostd, and bad requests refused with the right errno while nothing is stored partially."""

import errno
import fcntl
import os
import random
import subprocess
import threading
from pathlib import Path

import crc32c
import pytest

from connectors import llmd_read
from hostd import ioctl_abi as abi
from hostd.zerocopy import SharedBuffer, UnsupportedMemory, load_into, query, store_from
from support import MiB, pattern

ROOT = Path(__file__).resolve().parents[2]


def test_abi_matches_the_c_header(tmp_path):
    prog = tmp_path / "abi.c"
    prog.write_text("""
#include <stddef.h>
#include <stdio.h>
#include "bluecache_ioctl.h"
int main(void) {
  printf("%zu %zu %lu %lu %lu %zu %zu %zu %zu\\n", sizeof(struct bluecache_ioc_xfer),
    sizeof(struct bluecache_ioc_query), (unsigned long)BLUECACHE_IOC_STORE,
    (unsigned long)BLUECACHE_IOC_LOAD, (unsigned long)BLUECACHE_IOC_QUERY,
    offsetof(struct bluecache_ioc_xfer, cuda_ipc_handle),
    offsetof(struct bluecache_ioc_xfer, result_length),
    offsetof(struct bluecache_ioc_query, crc32c),
    offsetof(struct bluecache_ioc_query, zero_copy_bytes));
  return 0;
}""")
    subprocess.run(["cc", "-I", str(ROOT / "hostd/include"), "-o", str(tmp_path / "abi"),
                    str(prog)], check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "abi")], capture_output=True,
                                          text=True, check=True).stdout.split()]
    assert got == [abi.XFER.size, abi.QUERY.size, abi.IOC_STORE, abi.IOC_LOAD, abi.IOC_QUERY,
                   48, 112, 20, 32]


def test_c_example_from_the_docs_runs(mounted, tmp_path):
    s = mounted()
    exe = tmp_path / "ioctl_example"
    subprocess.run(["cc", "-Wall", "-Werror", "-I", str(ROOT / "hostd/include"), "-o", str(exe),
                    str(ROOT / "docs/examples/ioctl_example.c")], check=True)
    r = subprocess.run([str(exe), str(s.mnt / "example.bin")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "identical" in r.stdout and "hostd copied 0 bytes" in r.stdout
    assert os.path.getsize(s.mnt / "example.bin") == 32 * MiB


def test_store_load_query_byte_exact_with_no_copy_by_hostd(mounted):
    s = mounted()
    path = str(s.mnt / "m/block.bin")
    os.makedirs(os.path.dirname(path))
    data = pattern("zc", 32 * MiB)
    with SharedBuffer(32 * MiB) as src, SharedBuffer(32 * MiB) as dst:
        src.view()[:] = data
        before = query_counters(s)
        assert store_from(path, src) == 32 * MiB
        assert load_into(path, dst) == 32 * MiB
        assert dst.view() == data
        q = query(path)
        assert q["size"] == 32 * MiB and q["crc32c"] == crc32c.crc32c(data)
        assert q["hostd_bytes_copied"] == before["hostd_bytes_copied"]     # zero copy
        assert q["zero_copy_bytes"] - before["zero_copy_bytes"] == 64 * MiB
        # a slice of a shared buffer is shared memory too, with its offset
        part = dst.view()[MiB:3 * MiB]
        part[:] = bytes(2 * MiB)
        assert load_into(path, part, offset=5 * MiB) == 2 * MiB
        assert dst.view()[MiB:3 * MiB] == data[5 * MiB:7 * MiB]
        part.release()
    # a transfer is routine: no line per request at INFO in either daemon's log
    assert "released 1 regions" not in s.daemon.log_text()


def query_counters(s) -> dict:
    probe = s.mnt / ".counters"
    probe.write_bytes(b"x")
    return query(str(probe))


def test_mixed_with_posix_io_on_the_same_files(mounted):
    s = mounted()
    a, b = str(s.mnt / "a.bin"), str(s.mnt / "b.bin")
    with SharedBuffer(8 * MiB) as buf:
        buf.view()[:] = pattern("a", 8 * MiB)
        store_from(a, buf)
        with open(a, "rb") as f:                       # ioctl in, POSIX out
            assert f.read() == pattern("a", 8 * MiB)
        with open(b, "wb") as f:                       # POSIX in, ioctl out
            f.write(pattern("b", 5 * MiB + 17))
        buf.view()[:] = bytes(8 * MiB)
        assert load_into(b, buf) == 5 * MiB + 17
        assert buf.view()[:5 * MiB + 17] == pattern("b", 5 * MiB + 17)
        # a STORE replaces the whole content: a longer file becomes shorter
        buf.view()[:MiB] = pattern("c", MiB)
        with SharedBuffer(MiB) as small:
            small.view()[:] = pattern("c", MiB)
            store_from(b, small)
        with open(b, "rb") as f:
            assert f.read() == pattern("c", MiB)


def test_a_stored_file_shows_its_size_to_a_reader_at_once(mounted):
    # llm-d's reader: open, lseek(SEEK_END), read that many bytes. The kernel cached the new
    # file's size (0) at its CREATE; a STORE changes it behind the kernel's back, and a rename
    # refreshes only the ctime. A 0 here is a block loaded as empty, reported as a hit.
    s = mounted()
    with SharedBuffer(8 * MiB) as buf:
        for i in range(3):
            buf.view()[:] = pattern(f"s{i}", 8 * MiB)
            path = str(s.mnt / f"s{i}.bin")
            store_from(path, buf)
            fd = os.open(path, os.O_RDONLY)
            try:
                assert os.lseek(fd, 0, os.SEEK_END) == 8 * MiB
            finally:
                os.close(fd)
            assert llmd_read(str(s.mnt), f"s{i}.bin") == pattern(f"s{i}", 8 * MiB)


def test_concurrent_stores_and_loads(mounted):
    s = mounted(**{"tiers.dram.size": "1GiB"})
    errors = []

    def worker(k):
        try:
            with SharedBuffer(4 * MiB) as src, SharedBuffer(4 * MiB) as dst:
                for i in range(6):
                    data = pattern(f"{k}/{i}", 4 * MiB)
                    src.view()[:] = data
                    path = str(s.mnt / f"t{k}_{i}.bin")
                    store_from(path, src)
                    load_into(path, dst)
                    if dst.view() != data:
                        errors.append(path)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_unsupported_memory_gets_a_clear_error(mounted):
    s = mounted()
    with pytest.raises(UnsupportedMemory, match="SharedBuffer"):
        store_from(str(s.mnt / "x.bin"), bytearray(4096))
    with pytest.raises(UnsupportedMemory):
        store_from(str(s.mnt / "x.bin"), b"read-only bytes")
    assert not os.path.exists(s.mnt / "x.bin")


# -- bad input ---------------------------------------------------------------------------------

def raw_ioctl(path, cmd, payload: bytes, mode=os.O_RDWR) -> bytes:
    fd = os.open(path, mode)
    try:
        buf = bytearray(payload)
        fcntl.ioctl(fd, cmd, buf, True)
        return bytes(buf)
    finally:
        os.close(fd)


@pytest.fixture
def victim(mounted):
    """A mounted stack with one file whose content must survive every bad request."""
    s = mounted(allow_log=[])
    path = s.mnt / "victim.bin"
    path.write_bytes(pattern("keep", 3 * MiB))
    buf = SharedBuffer(MiB)
    yield s, str(path), buf
    buf.close()
    assert path.read_bytes() == pattern("keep", 3 * MiB)     # nothing stored partially


def xfer(buf, **fields) -> bytes:
    x = abi.Xfer(mem_kind=abi.MEM_MEMFD, fd=buf.fd, length=buf.size)
    for k, v in fields.items():
        setattr(x, k, v)
    return x.pack()


def unsealed_memfd():
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, MiB)
    return fd


BAD = [
    ("wrong version", lambda b: xfer(b, version=2), errno.EINVAL),
    ("wrong struct size", lambda b: xfer(b, struct_size=128), errno.EINVAL),
    ("unknown kind", lambda b: xfer(b, mem_kind=9), errno.EINVAL),
    ("flags", lambda b: xfer(b, flags=1), errno.EINVAL),
    ("reserved bytes", lambda b: xfer(b, reserved=b"\1" + bytes(127)), errno.EINVAL),
    ("huge length", lambda b: xfer(b, length=(1 << 64) - 1), errno.EINVAL),
    ("huge offset", lambda b: xfer(b, mem_offset=(1 << 63) + 5), errno.EINVAL),
    ("span past the memfd", lambda b: xfer(b, mem_offset=4096), errno.EFAULT),
    ("negative fd", lambda b: xfer(b, fd=-1), errno.EBADF),
    ("fd the caller does not have", lambda b: xfer(b, fd=987654), errno.EBADF),
    ("not a memfd", lambda b: xfer(b, fd=0), errno.EINVAL),
    ("STORE with a file offset", lambda b: xfer(b, file_offset=10), errno.EINVAL),
    ("CUDA with an all-zero handle", lambda b: xfer(b, mem_kind=abi.MEM_CUDA_IPC), errno.EINVAL),
]


@pytest.mark.parametrize("name,make,err", BAD, ids=[b[0] for b in BAD])
def test_bad_store_requests(victim, name, make, err):
    s, path, buf = victim
    with pytest.raises(OSError) as e:
        raw_ioctl(path, abi.IOC_STORE, make(buf))
    assert e.value.errno == err, name


def _cuda_usable() -> bool:
    """A real GPU (tests/gpu may have loaded the simulator into this process: ask a child)."""
    try:
        import cuda_sim
        return cuda_sim.real_device_count() > 0
    except Exception:  # no cuda-python, no libcuda
        return False


def test_cuda_handle_where_cuda_is_unusable_is_refused_and_stores_nothing(victim):
    s, path, buf = victim
    if _cuda_usable():
        pytest.skip("this machine has a usable GPU: tests/gpu exercises CUDA memory")
    with pytest.raises(OSError) as e:   # the fixture checks the file kept its content
        raw_ioctl(path, abi.IOC_STORE, xfer(buf, mem_kind=abi.MEM_CUDA_IPC,
                                            cuda_ipc_handle=bytes(range(1, 65))))
    assert e.value.errno == errno.EOPNOTSUPP
    # refused by whoever opens the handle (bluecached, or hostd for the doca engine), naming
    # what is missing, not by a blanket "CUDA unsupported" in hostd's validation
    why = s.hostd.log.read_text().split("ioctl")[-1]
    assert any(m in why for m in ("cuda-python", "CUDA driver", "CUDA device")), why
    with SharedBuffer(4096) as b:                  # still serving
        assert store_from(str(s.mnt / "after-cuda.bin"), b) == 4096


def test_a_write_sealed_memfd_is_a_store_source_not_a_load_target(victim):
    s, path, buf = victim
    data = pattern("sealed", MiB)
    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        (s.mnt / "sealed.bin").write_bytes(b"")
        out = abi.Xfer.unpack(raw_ioctl(str(s.mnt / "sealed.bin"), abi.IOC_STORE,
                                        xfer(buf, fd=fd, length=MiB)))
        assert out.result_length == MiB
        assert (s.mnt / "sealed.bin").read_bytes() == data
        with pytest.raises(OSError) as e:        # the fixture checks the victim is unchanged
            raw_ioctl(path, abi.IOC_LOAD, xfer(buf, fd=fd, length=MiB))
        assert e.value.errno == errno.EPERM
        assert "sealed against writing" in s.hostd.log.read_text() + s.daemon.log_text()
        assert os.pread(fd, MiB, 0) == data
    finally:
        os.close(fd)


def test_closed_and_unsealed_fds(victim):
    s, path, buf = victim
    fd = unsealed_memfd()
    with pytest.raises(OSError) as e:
        raw_ioctl(path, abi.IOC_STORE, xfer(buf, fd=fd))
    assert e.value.errno == errno.EINVAL
    high = os.dup2(buf.fd, 900)      # a number nothing else will reuse here
    os.close(high)
    os.close(fd)
    with pytest.raises(OSError) as e:                    # closed
        raw_ioctl(path, abi.IOC_STORE, xfer(buf, fd=high))
    assert e.value.errno == errno.EBADF


def test_an_fd_of_the_mount_itself_is_refused_without_deadlock(victim):
    s, path, buf = victim
    other = os.open(s.mnt / "other.bin", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OSError) as e:
            raw_ioctl(path, abi.IOC_STORE, xfer(buf, fd=other))
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(other)


def test_wrong_open_mode(victim):
    s, path, buf = victim
    with pytest.raises(OSError) as e:
        raw_ioctl(path, abi.IOC_STORE, xfer(buf), mode=os.O_RDONLY)
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        raw_ioctl(path, abi.IOC_LOAD, xfer(buf), mode=os.O_WRONLY)
    assert e.value.errno == errno.EBADF


def test_unknown_commands_and_sizes(victim):
    s, path, buf = victim
    for cmd in (abi.IOC_STORE + 7, (abi.IOC_STORE & ~(0x3FFF << 16)) | (16 << 16), 0x5401):
        with pytest.raises(OSError) as e:
            raw_ioctl(path, cmd, bytes(16))
        assert e.value.errno in (errno.ENOTTY, errno.EINVAL)


def test_random_payloads_never_break_the_daemon(victim):
    s, path, buf = victim
    rng = random.Random(1234)
    for _ in range(300):
        payload = bytearray(rng.randbytes(abi.XFER.size))
        if rng.random() < 0.7:   # mostly well-formed headers, so validation deeper down runs
            payload[:8] = abi.XFER.pack(*abi.Xfer(fd=buf.fd).__dict__.values())[:8]
            payload[8:12] = rng.choice([1, 2, 3, 0, 77]).to_bytes(4, "little")
        cmd = rng.choice([abi.IOC_STORE, abi.IOC_LOAD])
        try:
            raw_ioctl(path, cmd, bytes(payload))
        except OSError as e:
            assert e.errno in (errno.EINVAL, errno.EBADF, errno.EFAULT, errno.EPERM,
                               errno.EOPNOTSUPP), e
    with SharedBuffer(4096) as b:                  # still serving
        store_from(str(s.mnt / "after.bin"), b)


def test_a_load_during_stores_to_the_same_file_sees_one_whole_version(mounted):
    s = mounted(**{"tiers.dram.size": "512MiB"})
    path = str(s.mnt / "contended.bin")
    versions = [pattern(f"v{k}", 8 * MiB) for k in range(2)]
    (s.mnt / "contended.bin").write_bytes(versions[0])
    stop = threading.Event()
    seen, errors = set(), []

    def storer(k):
        with SharedBuffer(8 * MiB) as src:
            src.view()[:] = versions[k]
            while not stop.is_set():
                try:
                    raw_ioctl(path, abi.IOC_STORE, xfer(src, length=8 * MiB))
                except OSError as e:
                    errors.append(e)
                    return

    threads = [threading.Thread(target=storer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        with SharedBuffer(8 * MiB) as dst:
            for _ in range(40):
                raw_ioctl(path, abi.IOC_LOAD, xfer(dst, length=8 * MiB), mode=os.O_RDONLY)
                got = bytes(dst.view())
                assert got in versions, "a LOAD mixed two STOREs"
                seen.add(versions.index(got))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors
