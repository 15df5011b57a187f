"""user.* extended attributes through a real mount: vLLM's per-block checksum sequence (the
CRC32C set as `user.vllm.kv_crc32c` on the temp file before the rename, checked after each
read), the flags, limits and namespaces as the kernel and the daemon answer them, permissions
as a second user meets them, and the attributes after bluecached restarts (clean or killed)."""

import ctypes
import errno
import os
import signal
import subprocess
import sys

import crc32c
import pytest

from support import AS_NOBODY, NOBODY, MiB, force_unmount, let_others_reach, pattern, wait_settled

CRC_NAME = "user.vllm.kv_crc32c"
BLOCK = 4 * MiB


@pytest.fixture
def engine():
    """Attributes are metadata: the DMA engine moves none of them."""
    return "loopback"


def vllm_store(root, rel: str, data: bytes, tag: str) -> None:
    """vLLM's FS tier store with checksums on: exists? -> makedirs -> O_EXCL temp file, one
    write, close -> the CRC32C as an xattr on the temp file -> os.replace over the name."""
    dst = os.path.join(root, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}_{tag}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)
    os.setxattr(tmp, CRC_NAME, str(crc32c.crc32c(data)).encode())
    os.replace(tmp, dst)


def vllm_load(root, rel: str) -> bytes:
    """vLLM's load with checksums on: read the whole block, compare with the xattr."""
    path = os.path.join(root, rel)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        assert os.readv(fd, [buf]) == size
    finally:
        os.close(fd)
    expected = int(os.getxattr(path, CRC_NAME))
    if crc32c.crc32c(bytes(buf)) != expected:
        raise AssertionError(f"{rel}: checksum mismatch")
    return bytes(buf)


def raw_getxattr(path: str, name: str, size: int) -> tuple[int, int]:
    """getxattr(2) with a buffer of `size` bytes: (return value, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.getxattr.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(max(size, 1))
    n = libc.getxattr(os.fsencode(path), name.encode(), buf if size else None,
                      ctypes.c_size_t(size))
    return n, ctypes.get_errno() if n < 0 else 0


def _errno(fn, *args, **kw) -> int:
    with pytest.raises(OSError) as e:
        fn(*args, **kw)
    return e.value.errno


def restart(stack, sig: int) -> None:
    stack.hostd.stop(timeout=30)
    force_unmount(stack.mnt)
    stack.daemon.stop(sig, timeout=60)
    stack.daemon.start()
    stack.hostd.start()


def test_vllms_checksum_sequence_and_rename_over_an_existing_block(mounted):
    s = mounted()
    root = str(s.mnt)
    rel = "model_abc/000/00_g0/" + "ab" * 32 + ".bin"
    old, new = pattern("old", BLOCK), pattern("new", BLOCK + 12345)
    vllm_store(root, rel, old, "t1")
    assert vllm_load(root, rel) == old
    assert os.listxattr(os.path.join(root, rel)) == [CRC_NAME]
    # another writer's block renamed over it: its checksum wins, the old one is gone
    vllm_store(root, rel, new, "t2")
    assert vllm_load(root, rel) == new
    assert os.listxattr(os.path.join(root, rel)) == [CRC_NAME]
    assert sorted(os.listdir(os.path.dirname(os.path.join(root, rel)))) == [rel.rsplit("/")[-1]]
    # a checksum that does not match is what the reader sees, not hidden
    os.setxattr(os.path.join(root, rel), CRC_NAME, b"1")
    with pytest.raises(AssertionError, match="checksum mismatch"):
        vllm_load(root, rel)
    os.unlink(os.path.join(root, rel))
    vllm_store(root, rel, old, "t3")   # a new file under the name: only its own attribute
    assert vllm_load(root, rel) == old


def test_flags_sizes_limits_and_namespaces_through_the_kernel(mounted):
    s = mounted()
    path = str(s.path("f.bin"))
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    os.setxattr(path, "user.a", b"12345")
    assert raw_getxattr(path, "user.a", 0) == (5, 0)                 # size query
    assert raw_getxattr(path, "user.a", 4) == (-1, errno.ERANGE)     # buffer too small
    assert raw_getxattr(path, "user.a", 5) == (5, 0)
    assert _errno(os.setxattr, path, "user.a", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert _errno(os.setxattr, path, "user.b", b"x", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(path, "user.b", b"", os.XATTR_CREATE)
    assert os.getxattr(path, "user.b") == b""
    os.setxattr(path, "user.a", b"replaced", os.XATTR_REPLACE)
    assert os.getxattr(path, "user.a") == b"replaced"
    os.removexattr(path, "user.b")
    assert _errno(os.getxattr, path, "user.b") == errno.ENODATA
    assert _errno(os.removexattr, path, "user.b") == errno.ENODATA
    big = pattern("v", 65536)
    os.setxattr(path, "user.big", big)                               # 64 KiB values hold
    assert os.getxattr(path, "user.big") == big
    assert _errno(os.setxattr, path, "user.big", big + b"!") == errno.E2BIG
    os.setxattr(path, "user." + "n" * 250, b"v")                       # 255 bytes in all
    assert _errno(os.setxattr, path, "user." + "n" * 251, b"v") == errno.ERANGE
    os.setxattr(path, "user.big2", big[:60000])
    assert _errno(os.setxattr, path, "user.big3", big[:10000]) == errno.ENOSPC
    for name in ("trusted.x", "security.x", "security.capability", "system.posix_acl_access"):
        assert _errno(os.setxattr, path, name, b"v") in (errno.EOPNOTSUPP, errno.EINVAL), name
        assert _errno(os.getxattr, path, name) in (errno.EOPNOTSUPP, errno.ENODATA), name
    assert set(os.listxattr(path)) == {"user.a", "user.big", "user.big2", "user." + "n" * 250}
    # directories hold them; symlinks and special files refuse them (EPERM), as on ext4
    d = str(s.path("dir"))
    os.mkdir(d)
    os.setxattr(d, "user.d", b"dir")
    assert os.getxattr(d, "user.d") == b"dir"
    link = str(s.path("link"))
    os.symlink("f.bin", link)
    assert _errno(os.setxattr, link, "user.l", b"v", follow_symlinks=False) == errno.EPERM
    os.mkfifo(str(s.path("fifo")))
    assert _errno(os.setxattr, str(s.path("fifo")), "user.p", b"v") == errno.EPERM
    os.setxattr(link, "user.via_link", b"followed")                 # follows to f.bin
    assert os.getxattr(path, "user.via_link") == b"followed"
    # truncations (the kernel asks security.capability first, answered by hostd) still work
    os.truncate(path, 10)
    os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    assert os.stat(path).st_size == 0 and os.getxattr(path, "user.a") == b"replaced"


_AS_NOBODY = r"""
import os, sys
path, op = sys.argv[1], sys.argv[2]
try:
    if op == "get":
        os.getxattr(path, "user.a")
    elif op == "list":
        os.listxattr(path)
    elif op == "set":
        os.setxattr(path, "user.n", b"nobody")
    elif op == "remove":
        os.removexattr(path, "user.a")
    print(0)
except OSError as e:
    print(e.errno)
"""


def as_nobody(path: str, op: str) -> int:
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", _AS_NOBODY, path, op],
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip())


def test_reading_needs_read_permission_and_changing_needs_write_permission(mounted):
    s = mounted()
    root = str(s.mnt)
    let_others_reach(root)
    os.chmod(root, 0o755)
    readable, private, theirs = (str(s.path(n)) for n in ("readable", "private", "theirs"))
    for path in (readable, private, theirs):
        with open(path, "wb") as f:
            f.write(b"x")
        os.setxattr(path, "user.a", b"root's")
    os.chmod(readable, 0o644)
    os.chmod(private, 0o600)
    os.chown(theirs, NOBODY, NOBODY)
    os.chmod(theirs, 0o600)
    assert as_nobody(readable, "get") == 0
    assert as_nobody(readable, "set") == errno.EACCES
    assert as_nobody(readable, "remove") == errno.EACCES
    assert as_nobody(private, "get") == errno.EACCES
    assert as_nobody(theirs, "set") == 0 and as_nobody(theirs, "remove") == 0
    assert os.listxattr(theirs) == ["user.n"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_attributes_survive_a_restart_with_their_files(mounted, sig):
    s = mounted()
    root = str(s.mnt)
    blocks = {f"m/{i:02d}.bin": pattern(f"b{i}", BLOCK) for i in range(3)}
    for i, (rel, data) in enumerate(blocks.items()):
        vllm_store(root, rel, data, f"t{i}")
    os.setxattr(str(s.path("m")), "user.dir", b"kept")
    wait_settled(s.daemon)          # on NVMe with their attributes (a kill keeps that)
    os.setxattr(str(s.path("m/00.bin")), "user.later", b"after write-behind")
    restart(s, sig)
    for rel, data in blocks.items():
        assert vllm_load(root, rel) == data
    assert os.getxattr(str(s.path("m/00.bin")), "user.later") == b"after write-behind"
    assert os.getxattr(str(s.path("m")), "user.dir") == b"kept"


def test_another_host_checks_the_block_against_the_checksum_its_writer_set(mounted, ceph, bucket):
    from test_remote_mount import two_hosts, wait_for, wait_uploads

    a, b = two_hosts(mounted, ceph, bucket)
    blocks = {f"model_r0/{i:03x}/00_g0/{i:064x}.bin": pattern(f"r{i}", BLOCK) for i in range(3)}
    for i, (rel, data) in enumerate(blocks.items()):
        vllm_store(str(a.mnt), rel, data, f"t{i}")
    wait_uploads(a, len(blocks))
    big = pattern("big", 65536)          # past S3's 2 KB of metadata: a sidecar carries it
    os.setxattr(str(a.path(next(iter(blocks)))), "user.big", big)
    wait_uploads(a, len(blocks) + 1)     # the one whose attributes changed goes up again
    first = next(iter(blocks))
    wait_for(lambda: os.path.exists(b.path(first)), "B to see A's blocks", timeout=30)
    for rel, data in blocks.items():
        assert vllm_load(str(b.mnt), rel) == data
    assert os.getxattr(str(b.path(first)), "user.big") == big
