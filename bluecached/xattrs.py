"""Extended attributes in the `user.` namespace: the rules, the limits, and the per-inode table.

An inode's table (`Inode.xattrs`) is a dict name -> value (bytes both), or None when it has
none. A table is never changed in place: every change makes a new dict, so code that captured
one (an upload in flight) can tell by identity whether it is still current.

Limits are ext4's where ext4 has one, and the kernel's own checks for the rest (the kernel
refuses a name over XATTR_NAME_MAX or a value over XATTR_SIZE_MAX before the request reaches
FUSE; the daemon checks the same for clients that are not a kernel):
- a name is at most 255 bytes, the `user.` prefix included (ERANGE, as the kernel answers);
  `user.` alone is EINVAL, as the VFS answers;
- a value is at most 64 KiB (E2BIG);
- all names and values of one inode together at most 128 KiB (ENOSPC): one value of the
  largest size always fits beside smaller ones. ext4 holds one block (4 KiB) per inode in
  its default layout; the connectors set a few dozen bytes (vLLM: a CRC32C).
Other namespaces (`trusted.`, `security.`, `system.`, including POSIX ACLs) are EOPNOTSUPP.
As on ext4, user attributes exist only on regular files and directories: on a symlink, FIFO,
socket or device a set or remove is EPERM, a get ENODATA and a list empty.
"""

import errno
import stat

from .namespace import FsError, Inode

PREFIX = b"user."
NAME_MAX = 255            # XATTR_NAME_MAX: the whole name
VALUE_MAX = 65536         # XATTR_SIZE_MAX
TOTAL_MAX = 128 * 1024    # names and values of one inode together

XATTR_CREATE = 1          # linux/xattr.h
XATTR_REPLACE = 2


def check_name(name: bytes) -> None:
    if not name or len(name) > NAME_MAX:
        raise FsError(errno.ERANGE, f"an attribute name is 1 to {NAME_MAX} bytes, "
                                    f"not {len(name)}")
    if not name.startswith(PREFIX):
        raise FsError(errno.EOPNOTSUPP, "only user.* extended attributes are supported")
    if name == PREFIX:
        raise FsError(errno.EINVAL, "an attribute name needs something after 'user.'")
    if b"\0" in name:
        raise FsError(errno.EINVAL, "an attribute name cannot hold a NUL byte")


def _holds_user_xattrs(node: Inode) -> bool:
    return stat.S_ISREG(node.mode) or stat.S_ISDIR(node.mode)


def total(table: dict | None) -> int:
    return sum(len(n) + len(v) for n, v in table.items()) if table else 0


def get(node: Inode, name: bytes) -> bytes:
    check_name(name)
    table = node.xattrs if _holds_user_xattrs(node) else None
    value = table.get(name) if table else None
    if value is None:
        raise FsError(errno.ENODATA, f"no attribute {name!r}")
    return value


def names(node: Inode) -> list[bytes]:
    return list(node.xattrs) if node.xattrs and _holds_user_xattrs(node) else []


def set_(node: Inode, name: bytes, value: bytes, flags: int = 0) -> None:
    """Sets `name` on the inode (the caller records the change)."""
    check_name(name)
    if flags & ~(XATTR_CREATE | XATTR_REPLACE):
        raise FsError(errno.EINVAL, f"unknown setxattr flags {flags:#x}")
    if not _holds_user_xattrs(node):
        raise FsError(errno.EPERM, "user attributes only on regular files and directories")
    if len(value) > VALUE_MAX:
        raise FsError(errno.E2BIG, f"an attribute value is at most {VALUE_MAX} bytes")
    table = node.xattrs or {}
    old = table.get(name)
    if old is not None and flags & XATTR_CREATE:
        raise FsError(errno.EEXIST, f"attribute {name!r} exists")
    if old is None and flags & XATTR_REPLACE:
        raise FsError(errno.ENODATA, f"no attribute {name!r} to replace")
    grown = total(table) + len(value) - (len(old) if old is not None else -len(name))
    if grown > TOTAL_MAX:
        raise FsError(errno.ENOSPC, f"the attributes of one file hold at most {TOTAL_MAX} "
                                    f"bytes of names and values")
    node.xattrs = {**table, name: bytes(value)}


def remove(node: Inode, name: bytes) -> None:
    check_name(name)
    if not _holds_user_xattrs(node):
        raise FsError(errno.EPERM, "user attributes only on regular files and directories")
    table = node.xattrs
    if not table or name not in table:
        raise FsError(errno.ENODATA, f"no attribute {name!r}")
    rest = {n: v for n, v in table.items() if n != name}
    node.xattrs = rest or None


# -- what the journal and the remote tier keep -----------------------------------------------

def to_pairs(table: dict | None) -> list:
    """The table as [[name, value], ...] (msgpack: bytes stay bytes)."""
    return [[n, v] for n, v in table.items()] if table else []


def from_pairs(pairs) -> dict | None:
    """The table from to_pairs' form; ValueError unless well formed and within the limits
    (a damaged record or a foreign S3 object must not plant attributes nobody could set)."""
    if not isinstance(pairs, list):
        raise ValueError("attributes are not a list")
    table = {}
    for pair in pairs:
        if (not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not bytes
                or type(pair[1]) is not bytes):
            raise ValueError("an attribute is not a [name, value] pair of bytes")
        name, value = pair
        try:
            check_name(name)
        except FsError as e:
            raise ValueError(f"attribute name {name!r}: {e}") from None
        if len(value) > VALUE_MAX:
            raise ValueError(f"attribute {name!r} is longer than {VALUE_MAX} bytes")
        table[name] = value
    if total(table) > TOTAL_MAX:
        raise ValueError("attributes exceed the per-file total")
    return table or None
