"""The connectors' exact syscall sequences (facts/posix-clients.md) on a real FUSE mount."""

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import MiB, pattern

BLOCK = 32 * MiB


def test_llmd_store_dedup_and_load_from_64_threads(mounted):
    s = mounted(**{"tiers.dram.size": "1GiB", "tiers.nvme.size": "4GiB"})
    root = str(s.mnt)
    blocks = {block_name(i % 24): pattern(f"blk{i % 24}", 4 * MiB) for i in range(64)}
    names = [block_name(i % 24) for i in range(64)]   # duplicates: dedup path and races

    def store(i):
        return llmd_write(root, names[i], blocks[names[i]], f"t{i}")

    with ThreadPoolExecutor(64) as pool:
        wrote = list(pool.map(store, range(64)))
    assert sum(wrote) >= 24
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda i: llmd_read(root, names[i]), range(64)))
    for i in range(64):
        assert got[i] == blocks[names[i]]
    leftovers = [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


def test_llmd_32mib_block_round_trip_and_scheduler_lookups(mounted):
    s = mounted()
    root = str(s.mnt)
    data = pattern("big", BLOCK)
    assert llmd_write(root, block_name(1), data, "x")
    assert llmd_read(root, block_name(1)) == data
    # scheduler: os.path.exists per chunk until the first miss
    assert os.path.exists(os.path.join(root, block_name(1)))
    assert not os.path.exists(os.path.join(root, block_name(2)))
    assert not llmd_write(root, block_name(1), data, "y")       # dedup


def test_vllm_store_and_load_with_o_direct(mounted):
    s = mounted()
    root = str(s.mnt)
    # vLLM's probe: O_CREAT|O_WRONLY|O_TRUNC|O_DIRECT, one page-aligned page
    probe = os.path.join(root, "probe")
    page = mmap.mmap(-1, 4096)
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
    assert os.write(fd, page) == 4096
    os.close(fd)
    os.unlink(probe)

    data = pattern("vllm", 16 * MiB)
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    dst = os.path.join(root, "m/ab/cd.bin")
    assert not os.path.exists(dst)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = dst + ".tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
    assert os.write(fd, buf) == len(data)
    os.close(fd)
    os.replace(tmp, dst)
    with pytest.raises(FileExistsError):
        os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    out = mmap.mmap(-1, len(data))
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECT)
    assert os.readv(fd, [out]) == len(data)
    os.close(fd)
    assert out[:] == data


def test_several_processes_at_once(mounted):
    import multiprocessing as mp
    s = mounted(**{"tiers.dram.size": "1GiB"})
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_process_worker, [(str(s.mnt), k) for k in range(4)])
    assert all(results)


def _process_worker(root: str, k: int) -> bool:
    for i in range(6):
        rel = block_name(100 + k * 10 + i)
        data = pattern(f"p{k}-{i}", 2 * MiB)
        llmd_write(root, rel, data, f"p{k}")
        if llmd_read(root, rel) != data:
            return False
    return True


def test_two_writers_of_one_name_leave_one_complete_version(mounted):
    s = mounted()
    root = str(s.mnt)
    versions = [pattern(f"v{k}", 8 * MiB) for k in range(2)]
    barrier = threading.Barrier(2)

    def write(k):
        barrier.wait()
        for round_ in range(5):
            dst = os.path.join(root, "same.bin")
            fd = os.open(f"{dst}_{k}_{round_}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.writev(fd, [versions[k]])
            os.rename(f"{dst}_{k}_{round_}.tmp", dst)
            os.close(fd)
            assert llmd_read(root, "same.bin") in versions

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert llmd_read(root, "same.bin") in versions


def test_posix_rules_through_the_kernel(mounted):
    s = mounted()
    root = str(s.mnt)
    os.mkdir(os.path.join(root, "d"))
    with pytest.raises(FileExistsError):
        os.mkdir(os.path.join(root, "d"))
    with open(os.path.join(root, "d/f"), "wb") as f:
        f.write(b"hello")
    with pytest.raises(OSError) as e:
        os.rmdir(os.path.join(root, "d"))
    assert e.value.errno == errno.ENOTEMPTY
    entries = {e.name: e for e in os.scandir(os.path.join(root, "d"))}
    assert entries["f"].is_file() and entries["f"].stat().st_size == 5   # d_type + attrs
    with pytest.raises(OSError) as e:
        os.link(os.path.join(root, "d"), os.path.join(root, "l"))
    assert e.value.errno == errno.EPERM   # no hard link to a directory; links: test_special_files
    os.setxattr(os.path.join(root, "d/f"), "user.x", b"1")   # user.* only (test_xattrs_mount)
    assert os.getxattr(os.path.join(root, "d/f"), "user.x") == b"1"
    with pytest.raises(OSError) as e:
        os.setxattr(os.path.join(root, "d/f"), "trusted.x", b"1")
    assert e.value.errno == errno.ENOTSUP
    with pytest.raises(OSError) as e:
        open(os.path.join(root, "n" * 256), "wb")
    assert e.value.errno == errno.ENAMETOOLONG
    os.truncate(os.path.join(root, "d/f"), 2)
    with open(os.path.join(root, "d/f"), "rb") as f:
        assert f.read() == b"he"
    st = os.statvfs(root)
    assert st.f_blocks * st.f_frsize == 1 << 30 and st.f_namemax == 255
    # unlink while open
    fd = os.open(os.path.join(root, "d/f"), os.O_RDONLY)
    os.unlink(os.path.join(root, "d/f"))
    assert os.read(fd, 10) == b"he"
    os.close(fd)
    os.rmdir(os.path.join(root, "d"))


def test_a_renamed_directory_keeps_its_links_and_takes_new_entries(mounted):
    s = mounted()
    root = str(s.mnt)
    os.makedirs(os.path.join(root, "a/sub"))
    os.rename(os.path.join(root, "a"), os.path.join(root, "b"))
    assert os.stat(os.path.join(root, "b")).st_nlink == 3   # ., its entry, sub's ..
    with open(os.path.join(root, "b/f"), "wb") as f:
        f.write(b"x")
    os.mkdir(os.path.join(root, "b/sub2"))
    os.rename(os.path.join(root, "b/sub"), os.path.join(root, "b/sub2/moved"))
    os.mkdir(os.path.join(root, "b/sub2/moved/deeper"))
    assert sorted(os.listdir(os.path.join(root, "b"))) == ["f", "sub2"]
    assert os.stat(os.path.join(root, "b")).st_nlink == 3
    assert os.stat(os.path.join(root, "b/sub2/moved")).st_nlink == 3
