"""The boundary: whatever the cache raises, the kernel gets a FUSEError with the errno of
fusefs/errors.py, and the mount goes on (an exception escaping a handler would end it)."""

import errno
import logging
import os
import stat

import pyfuse3
import pytest
from fake_kernel import ROOT, ctx, setattr_fields

from fusefs.errors import Refused, errno_for, errno_for_transfer

UNREACHABLE = [errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET, errno.EPROTO,
               errno.EBADMSG, errno.EMSGSIZE]
MEANINGFUL = [errno.ENOENT, errno.ENOSPC, errno.EFBIG, errno.ENAMETOOLONG, errno.EACCES,
              errno.EPERM, errno.EEXIST, errno.ENOTEMPTY, errno.EROFS]


@pytest.mark.parametrize("raised, seen", [
    *[(OSError(e, "transport"), errno.EIO) for e in UNREACHABLE],
    (OSError(errno.EFAULT, "staging span refused"), errno.EIO),
    *[(OSError(e, "cache says"), e) for e in MEANINGFUL],
    (OSError("no errno at all"), errno.EIO),
    (Refused(errno.EFAULT, "as asked"), errno.EFAULT),
])
def test_a_cache_error_becomes_the_errno_the_kernel_gets(kernel, cache, raised, seen):
    ino = kernel.write_file(ROOT, b"f", b"x")
    cache.fail("getattr", raised)
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call("getattr", ino, ctx())
    assert e.value.errno == seen
    assert kernel.call("getattr", ino, ctx()).st_size == 1   # and the next request is served


def test_a_bug_in_the_cache_is_eio_and_logged(kernel, cache, caplog):
    cache.fail("readlink", ZeroDivisionError("a bug"))
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call("readlink", ROOT, ctx())
    assert e.value.errno == errno.EIO
    assert "internal error in readlink" in caplog.text
    assert "ZeroDivisionError" in caplog.text


def test_eio_for_an_unreachable_cache_is_logged_with_its_cause(kernel, cache, caplog):
    caplog.set_level(logging.WARNING, "fusefs")
    cache.fail("statfs", OSError(errno.ETIMEDOUT, "bluecached unavailable for 30s"))
    with pytest.raises(pyfuse3.FUSEError):
        kernel.call("statfs", ctx())
    assert "statfs: [Errno 110] bluecached unavailable for 30s -> EIO" in caplog.text


def _requests(kernel):
    """Every handler that asks the cache, with arguments it accepts, by the cache call it
    makes first."""
    ino = kernel.write_file(ROOT, b"f", b"data")
    d = kernel.mkdir(ROOT, b"d").st_ino
    link = kernel.symlink(ROOT, b"l", b"f").st_ino
    fh = kernel.call("open", ino, os.O_RDWR, ctx()).fh
    size = setattr_fields(update_size=True)
    attrs = pyfuse3.EntryAttributes()
    return {
        "lookup": ("lookup", ROOT, b"f", ctx()),
        "getattr": ("getattr", ino, ctx()),
        "setattr": ("setattr", ino, attrs, size, None, ctx()),
        "statfs": ("statfs", ctx()),
        "mkdir": ("mkdir", ROOT, b"d2", stat.S_IFDIR | 0o755, ctx()),
        "rmdir": ("rmdir", ROOT, b"d", ctx()),
        "unlink": ("unlink", ROOT, b"f", ctx()),
        "rename": ("rename", ROOT, b"f", d, b"f", 0, ctx()),
        "readdir": ("readdir", d, 0, object()),
        "create": ("create", ROOT, b"new", stat.S_IFREG | 0o644, os.O_RDWR, ctx()),
        "mknod": ("mknod", ROOT, b"p", stat.S_IFIFO | 0o600, 0, ctx()),
        "symlink": ("symlink", ROOT, b"l2", b"f", ctx()),
        "readlink": ("readlink", link, ctx()),
        "link": ("link", ino, ROOT, b"h", ctx()),
        "open": ("open", ino, os.O_RDONLY, ctx()),
        "read": ("read", fh, 0, 4),
        "write": ("write", fh, 0, b"more"),
        "flush": ("flush", fh),
        "fsync": ("fsync", fh, False),
        "release": ("release", fh),
    }


@pytest.mark.parametrize("op", ["lookup", "getattr", "setattr", "statfs", "mkdir", "rmdir",
                                "unlink", "rename", "readdir", "create", "mknod", "symlink",
                                "readlink", "link", "open", "read", "write", "flush", "fsync",
                                "release"])
def test_every_request_goes_through_the_boundary(kernel, cache, op):
    request = _requests(kernel)[op]
    cache.fail(op, OSError(errno.ECONNRESET, "bluecached went away"))
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call(*request)
    assert e.value.errno == errno.EIO
    cache.fail(op, RuntimeError("a bug"))
    with pytest.raises(pyfuse3.FUSEError) as e:
        kernel.call(*request)
    assert e.value.errno == errno.EIO


def test_a_transfer_span_is_the_callers_memory_and_a_staging_span_is_not():
    """EFAULT from the daemon: for a POSIX request the span was hostd's staging (hostd's bug:
    EIO); for a zero-copy transfer it was the caller's memory (docs/ioctl.md: EFAULT)."""
    fault = OSError(errno.EFAULT, "span outside the region")
    assert errno_for(fault) == errno.EIO
    assert errno_for_transfer(fault) == errno.EFAULT
    for err in UNREACHABLE:
        assert errno_for(OSError(err, "")) == errno_for_transfer(OSError(err, "")) == errno.EIO
    for err in MEANINGFUL:
        assert errno_for(OSError(err, "")) == errno_for_transfer(OSError(err, "")) == err
