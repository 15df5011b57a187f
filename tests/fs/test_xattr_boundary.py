"""Extended attributes at the kernel boundary (fusefs alone, fake kernel): only user.* names
reach the cache; the rest, security.capability above all (the kernel asks it around writes),
is answered EOPNOTSUPP without a cache call; the cache's errors reach the kernel as they mean,
except ENOSYS, which the kernel would take as "never ask again"."""

import errno

import pyfuse3
import pytest
from fake_kernel import ROOT, TIMEOUTS, Kernel, ctx
from memory_cache import MemoryCache

from fusefs import Operations
from fusefs.errors import errno_for_xattr

XATTR_CALLS = {"setxattr", "getxattr", "listxattr", "removexattr"}


class XattrCache(MemoryCache):
    """The in-memory cache with a table per inode (no rules: those are the daemon's)."""

    def __init__(self):
        super().__init__()
        self.tables: dict[int, dict[bytes, bytes]] = {}

    async def setxattr(self, ino, name, value, flags=0):
        self._enter("setxattr")
        self.tables.setdefault(ino, {})[name] = bytes(value)

    async def getxattr(self, ino, name):
        self._enter("getxattr")
        try:
            return self.tables.get(ino, {})[name]
        except KeyError:
            raise OSError(errno.ENODATA, "no such attribute") from None

    async def listxattr(self, ino):
        self._enter("listxattr")
        return list(self.tables.get(ino, {}))

    async def removexattr(self, ino, name):
        self._enter("removexattr")
        if name not in self.tables.get(ino, {}):
            raise OSError(errno.ENODATA, "no such attribute")
        del self.tables[ino][name]


@pytest.fixture
def cache() -> XattrCache:
    return XattrCache()


def _errno(kernel, *request) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call(*request)
    return e.value.errno


def test_user_attributes_reach_the_cache(kernel, cache):
    ino = kernel.write_file(ROOT, b"blk.bin", b"data")
    kernel.call("setxattr", ino, b"user.vllm.kv_crc32c", b"\x01\x02\x03\x04", ctx())
    assert kernel.call("getxattr", ino, b"user.vllm.kv_crc32c", ctx()) == b"\x01\x02\x03\x04"
    assert kernel.call("listxattr", ino, ctx()) == [b"user.vllm.kv_crc32c"]
    kernel.call("removexattr", ino, b"user.vllm.kv_crc32c", ctx())
    assert _errno(kernel, "getxattr", ino, b"user.vllm.kv_crc32c", ctx()) == errno.ENODATA
    assert cache.tables[ino] == {}


@pytest.mark.parametrize("name", [b"security.capability", b"security.selinux", b"trusted.x",
                                  b"system.posix_acl_access", b"system.posix_acl_default",
                                  b"os2.name", b"user"])
def test_other_namespaces_are_answered_here_without_a_cache_call(kernel, cache, name):
    ino = kernel.write_file(ROOT, b"f", b"x")
    before = len(cache.calls)
    assert _errno(kernel, "getxattr", ino, name, ctx()) == errno.EOPNOTSUPP
    assert _errno(kernel, "setxattr", ino, name, b"v", ctx()) == errno.EOPNOTSUPP
    assert _errno(kernel, "removexattr", ino, name, ctx()) == errno.EOPNOTSUPP
    assert not XATTR_CALLS & set(cache.calls[before:])


@pytest.mark.parametrize("raised, seen", [
    *[(err, err) for err in (errno.ENODATA, errno.EEXIST, errno.ERANGE, errno.E2BIG,
                             errno.ENOSPC, errno.EPERM, errno.EOPNOTSUPP, errno.ENOENT)],
    (errno.ENOSYS, errno.EOPNOTSUPP),   # an older daemon or cache: not "never ask again"
    (errno.ECONNRESET, errno.EIO),      # the daemon went away: as every request
    (errno.ETIMEDOUT, errno.EIO),
])
@pytest.mark.parametrize("op", sorted(XATTR_CALLS))
def test_the_caches_errors_reach_the_kernel_as_they_mean(kernel, cache, op, raised, seen):
    ino = kernel.write_file(ROOT, b"f", b"x")
    args = {"setxattr": (ino, b"user.a", b"v"), "getxattr": (ino, b"user.a"),
            "listxattr": (ino,), "removexattr": (ino, b"user.a")}[op]
    cache.fail(op, OSError(raised, "cache says"))
    assert _errno(kernel, op, *args, ctx()) == seen
    assert errno_for_xattr(OSError(raised, "")) == seen


def test_a_cache_without_attributes_answers_eopnotsupp():
    kernel = Kernel(Operations(MemoryCache(), TIMEOUTS))
    ino = kernel.write_file(ROOT, b"f", b"x")
    assert _errno(kernel, "getxattr", ino, b"user.a", ctx()) == errno.EOPNOTSUPP
    assert _errno(kernel, "setxattr", ino, b"user.a", b"v", ctx()) == errno.EOPNOTSUPP
    assert _errno(kernel, "listxattr", ino, ctx()) == errno.EOPNOTSUPP
    assert _errno(kernel, "removexattr", ino, b"user.a", ctx()) == errno.EOPNOTSUPP
