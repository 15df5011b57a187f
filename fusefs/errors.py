"""The errno the kernel gets: one map for every reply fusefs writes.

Three paths answer the kernel: Operations (pyfuse3), writes received in place and the zero-copy
ioctl (both through the fuse shim). A failure reaches them as an OSError. Two kinds:

- `Refused`: the request itself cannot be served as asked (a bad ioctl struct, an fd that is
  not the memory it claims). Its errno is the caller's answer, unchanged.
- any other OSError: the cache failed, with the errno the cache means. Most pass through
  (ENOENT, ENOSPC, EFBIG, ...: they mean the same to an application); those below become EIO.
"""

import errno

# The cache daemon could not be reached or understood. An application can do nothing with the
# transport's own errno; EIO ("the storage behind this file failed") is the one every program
# handles, and what docs/operations.md and docs/ioctl.md promise.
_DAEMON_UNREACHABLE = frozenset({
    errno.ETIMEDOUT,     # no answer within hostd's daemon.request_timeout
    errno.ECONNREFUSED,  # the daemon is not running
    errno.ECONNRESET,    # it went away mid-request (a restart the request could not wait out)
    errno.EPROTO,        # version or handshake trouble between hostd and the daemon
    errno.EBADMSG,       # a message one side could not decode
    errno.EMSGSIZE,      # a message over the protocol's size limit
})

# A POSIX request's bytes travel through hostd's staging slots, so a span the daemon refuses
# there is hostd's bug, not the application's: EIO. A zero-copy transfer's span is the caller's
# own memory, so there EFAULT is the caller's to hear (docs/ioctl.md).
_STAGING_SPAN = frozenset({errno.EFAULT})


class Refused(OSError):
    """The request is wrong as asked: `errno` goes to the caller as it is."""

    def __init__(self, err: int, why: str):
        super().__init__(err, why)


def errno_for(e: OSError) -> int:
    """The errno an application sees for a POSIX request (or a write received in place)."""
    if isinstance(e, Refused):
        return e.errno
    if e.errno is None or e.errno in _DAEMON_UNREACHABLE or e.errno in _STAGING_SPAN:
        return errno.EIO
    return e.errno


def errno_for_transfer(e: OSError) -> int:
    """The errno the caller of a zero-copy ioctl sees: the memory moved is the caller's."""
    if isinstance(e, Refused):
        return e.errno
    if e.errno is None or e.errno in _DAEMON_UNREACHABLE:
        return errno.EIO
    return e.errno


def errno_for_xattr(e: OSError) -> int:
    """An extended-attribute request's errno: as errno_for, but ENOSYS (a daemon or cache that
    lacks the operation) becomes EOPNOTSUPP. The kernel takes ENOSYS from a getxattr or
    setxattr to mean "never ask again" for the whole mount, so an upgraded daemon behind it
    would stay unused until a remount; EOPNOTSUPP is the file system's "no such attributes"."""
    err = errno_for(e)
    return errno.EOPNOTSUPP if err == errno.ENOSYS else err
