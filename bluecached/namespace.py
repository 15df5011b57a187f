"""The namespace bluecached owns: inodes, directories and the POSIX rules between them.

Pure in-memory bookkeeping with no I/O, so every rule here is testable directly. Errors are
FsError carrying the errno the kernel will hand to the application; the store decides what
happens to the bytes of an inode that leaves the namespace.
"""

import errno
import os
import stat
import time
from collections.abc import Iterator

ROOT_INO = 1  # FUSE_ROOT_ID
NAME_MAX = 255
# A symlink's target: PATH_MAX (4096) with its terminating NUL, the limit tmpfs applies.
SYMLINK_MAX = 4095
# A writer's temporary: the connectors write `<block>_<tag>.tmp` (llm-d) or `<block>.<tag>.tmp`
# (vLLM), then rename it to the block's name. Never uploaded, collected when orphaned.
TMP_SUFFIX = b".tmp"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class FsError(Exception):
    def __init__(self, err: int, message: str = ""):
        self.errno = err
        self.message = message or os.strerror(err)
        super().__init__(err, self.message)

    def __str__(self) -> str:
        return self.message


# Inodes without data: their attributes are the whole of them.
META_TYPES = frozenset({stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK})
TYPES = META_TYPES | {stat.S_IFDIR, stat.S_IFREG}


class Inode:
    __slots__ = (
        "ino", "mode", "uid", "gid", "nlink", "size",
        "atime_ns", "mtime_ns", "ctime_ns",
        "parent", "name",   # where it is linked (None, None once unlinked)
        "extra",            # a file's other names (hard links): [(parent, name), ...] or None
        "children",         # directories: name -> (cookie, ino), insertion (= cookie) order
        "next_cookie",
        "obj",              # regular files: the store's data record
        "target",           # symlinks: what the link points at (bytes), else None
        "rdev",             # character and block devices: the device number, else 0
        "xattrs",           # user.* extended attributes: {name: value} or None (xattrs.py)
    )

    def __init__(self, ino: int, mode: int, uid: int, gid: int, now: int):
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.size = 0
        self.atime_ns = self.mtime_ns = self.ctime_ns = now
        self.parent: int | None = None
        self.name: bytes | None = None
        self.extra: list[tuple[int, bytes]] | None = None
        self.obj = None
        self.target: bytes | None = None
        self.rdev = 0
        self.xattrs: dict[bytes, bytes] | None = None
        if stat.S_ISDIR(mode):
            self.nlink = 2
            self.children: dict[bytes, tuple[int, int]] | None = {}
            self.next_cookie = 1
        else:
            self.nlink = 1
            self.children = None
            self.next_cookie = 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    def names(self) -> list[tuple[int, bytes]]:
        """Every (parent, name) of the inode: the first is (parent, name), the one paths,
        events and the remote tier's key use; a file with hard links has more."""
        if self.parent is None:
            return []
        return [(self.parent, self.name), *(self.extra or ())]

    @property
    def is_meta(self) -> bool:
        """A symlink, FIFO, socket or device node: attributes only (and a symlink's target),
        no object bytes in any tier. The index holds all of it; the tiers never see it."""
        return stat.S_IFMT(self.mode) in META_TYPES

    def attrs(self) -> dict:
        return {
            "ino": self.ino, "mode": self.mode, "nlink": self.nlink,
            "uid": self.uid, "gid": self.gid, "size": self.size, "rdev": self.rdev,
            "atime_ns": self.atime_ns, "mtime_ns": self.mtime_ns, "ctime_ns": self.ctime_ns,
        }


def check_length(name: bytes) -> None:
    """Every operation that takes a name refuses one longer than NAME_MAX, as Linux file
    systems do: a lookup too, so chmod or unlink of such a name is ENAMETOOLONG, not ENOENT."""
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name is {len(name)} bytes, the limit is {NAME_MAX}")


def check_name(name: bytes) -> None:
    """A name a new entry may get."""
    check_length(name)
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise FsError(errno.EINVAL, f"invalid file name {name!r}")


def check_target(target: bytes) -> None:
    """A symlink's target, as Linux takes it: not empty (ENOENT), no NUL, at most PATH_MAX
    with its NUL (ENAMETOOLONG, as tmpfs)."""
    if not target:
        raise FsError(errno.ENOENT, "a symlink's target cannot be empty")
    if b"\0" in target:
        raise FsError(errno.EINVAL, "a symlink's target cannot hold a NUL byte")
    if len(target) > SYMLINK_MAX:
        raise FsError(errno.ENAMETOOLONG, f"symlink target is {len(target)} bytes, the limit "
                                          f"is {SYMLINK_MAX}")


def mode_after_unprivileged_write(mode: int) -> int:
    """A regular file's mode once written or truncated by a user without CAP_FSETID: S_ISUID
    goes, and S_ISGID when the group may execute (without group execute it marks mandatory
    locking and stays: the rule the kernel itself applies for FUSE, fs/fuse/dir.c)."""
    kill = mode & stat.S_ISUID
    if mode & stat.S_IXGRP:
        kill |= mode & stat.S_ISGID
    return mode & ~kill


class Namespace:
    """Inode table and directory tree. `new_ino` hands out inode numbers (the store makes them
    unique across restarts); `issued_now` tells whether a number is one of this run's."""

    def __init__(self, new_ino, clock=time.time_ns, issued_now=lambda ino: True):
        self._new_ino = new_ino
        self._issued_now = issued_now
        self.clock = clock
        self.inodes: dict[int, Inode] = {}
        root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, clock())
        self.inodes[ROOT_INO] = root

    # -- queries ---------------------------------------------------------------------------

    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            if self._issued_now(ino):   # removed in this run (a directory at its rmdir)
                raise FsError(errno.ENOENT, f"no inode {ino}") from None
            # A number from a run before this one that this run does not have: a client's
            # kernel held it across the restart, and its file went (lost in a crash before
            # it was written behind, or removed while held). ESTALE, as NFS says of such a
            # handle: the kernel then looks the path up again (LOOKUP_REVAL), where ENOENT
            # would fail the call, an O_CREAT open of the same name included, for as long as
            # it trusts its cached name (mount.entry_timeout).
            raise FsError(errno.ESTALE, f"no inode {ino} (from before a restart)") from None

    def directory(self, ino: int) -> Inode:
        node = self.get(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR, f"inode {ino} is not a directory")
        return node

    def lookup(self, parent: int, name: bytes) -> Inode:
        check_length(name)
        entry = self.directory(parent).children.get(name)
        if entry is None:
            raise FsError(errno.ENOENT)
        return self.inodes[entry[1]]

    def resolve(self, path: str | bytes) -> Inode:
        """Inode at a path relative to the root ('' or '/' is the root)."""
        if isinstance(path, str):
            path = path.encode()
        node = self.inodes[ROOT_INO]
        for part in path.split(b"/"):
            if part:
                node = self.lookup(node.ino, part)
        return node

    def path_of(self, node: Inode) -> bytes:
        parts = []
        while node.ino != ROOT_INO:
            if node.parent is None:
                return b""
            parts.append(node.name)
            node = self.inodes[node.parent]
        return b"/" + b"/".join(reversed(parts))

    def readdir(self, ino: int, offset: int, limit: int) -> list[tuple[bytes, Inode, int]]:
        """Entries whose cookie is above `offset`: (name, inode, cookie). Cookies never change
        while an entry stays, so a listing interrupted by creates and unlinks resumes correctly."""
        out = []
        for name, (cookie, child) in self.directory(ino).children.items():
            if cookie > offset:
                out.append((name, self.inodes[child], cookie))
                if len(out) >= limit:
                    break
        return out

    def parent_of(self, ino: int) -> int:
        """The inode a directory's `..` names: its parent, or the root itself for the root."""
        node = self.directory(ino)
        return node.parent if node.parent is not None else node.ino

    def walk(self, top: Inode | None = None) -> Iterator[Inode]:
        """Every inode below `top` (default root), parents before children; a file with
        several names there once."""
        stack = [top or self.inodes[ROOT_INO]]
        seen: set[int] = set()   # files with hard links (few: the rest cost nothing here)
        while stack:
            node = stack.pop()
            if node.extra is not None:
                if node.ino in seen:
                    continue
                seen.add(node.ino)
            yield node
            if node.is_dir:
                stack.extend(self.inodes[c] for _, c in node.children.values())

    # -- mutations -------------------------------------------------------------------------

    def _link(self, parent: Inode, name: bytes, node: Inode) -> None:
        """Gives `node` the name (parent, name): its first, or one more (a hard link)."""
        parent.children[name] = (parent.next_cookie, node.ino)
        parent.next_cookie += 1
        if node.parent is None:
            node.parent, node.name = parent.ino, name
        else:
            node.extra = [*(node.extra or ()), (parent.ino, name)]
        if node.is_dir:
            parent.nlink += 1
        else:
            node.nlink = 1 + len(node.extra or ())

    def _unlink_entry(self, parent: Inode, name: bytes) -> Inode:
        """Takes the name (parent, name) away from the inode that has it. A file keeps its
        other names (the next becomes its first); its nlink counts what is left. A
        directory's own nlink stays (a rename moves it; rmdir sets it to 0)."""
        _, child_ino = parent.children.pop(name)
        child = self.inodes[child_ino]
        if (child.parent, child.name) == (parent.ino, name):
            if child.extra:
                (child.parent, child.name), *rest = child.extra
                child.extra = rest or None
            else:
                child.parent = child.name = None
        else:
            child.extra.remove((parent.ino, name))
            child.extra = child.extra or None
        if child.is_dir:
            parent.nlink -= 1
        else:
            child.nlink = len(child.names())
        return child

    def _touch_dir(self, node: Inode, now: int) -> None:
        node.mtime_ns = node.ctime_ns = now

    def add(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
            ino: int | None = None, rdev: int = 0, target: bytes | None = None) -> Inode:
        """A new inode at (parent, name); EEXIST if the name is taken. Symlinks take their
        `target`, character and block devices their `rdev`."""
        check_name(name)
        kind = stat.S_IFMT(mode)
        if kind not in TYPES:
            raise FsError(errno.EINVAL, f"unknown file type {kind:#o}")
        if kind == stat.S_IFLNK:
            check_target(target)
        parent = self.directory(parent_ino)
        if parent.nlink == 0:
            raise FsError(errno.ENOENT, "directory was removed")
        if name in parent.children:
            raise FsError(errno.EEXIST)
        now = self.clock()
        node = Inode(self._new_ino() if ino is None else ino, mode, uid, gid, now)
        if kind == stat.S_IFLNK:
            node.target, node.size = target, len(target)
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            node.rdev = rdev
        self.inodes[node.ino] = node
        self._link(parent, name, node)
        self._touch_dir(parent, now)
        return node

    def link(self, ino: int, new_parent_ino: int, new_name: bytes) -> Inode:
        """A hard link: the file (or symlink, or special file) `ino` gets the name
        (new_parent, new_name) too."""
        check_name(new_name)
        node = self.get(ino)
        if node.is_dir:
            raise FsError(errno.EPERM, "no hard links to directories")
        parent = self.directory(new_parent_ino)
        if parent.nlink == 0:
            raise FsError(errno.ENOENT, "directory was removed")
        if new_name in parent.children:
            raise FsError(errno.EEXIST)
        if node.parent is None:
            raise FsError(errno.ENOENT, "the file was removed")
        self._link(parent, new_name, node)
        now = self.clock()
        self._touch_dir(parent, now)
        node.ctime_ns = now
        return node

    def unlink(self, parent_ino: int, name: bytes) -> Inode:
        """Removes a file's name. The inode stays in the table: the store drops it when unused
        (once it has no name left)."""
        node = self.lookup(parent_ino, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        parent = self.inodes[parent_ino]
        self._unlink_entry(parent, name)
        now = self.clock()
        self._touch_dir(parent, now)
        node.ctime_ns = now
        return node

    def rmdir(self, parent_ino: int, name: bytes) -> Inode:
        node = self.lookup(parent_ino, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        parent = self.inodes[parent_ino]
        self._unlink_entry(parent, name)
        node.nlink = 0
        self._touch_dir(parent, self.clock())
        del self.inodes[node.ino]
        return node

    def forget(self, node: Inode) -> None:
        """Drops an unlinked file's inode from the table (its last user went away)."""
        if node.parent is None:
            self.inodes.pop(node.ino, None)

    def rename(self, parent_ino: int, name: bytes, new_parent_ino: int, new_name: bytes,
               flags: int = 0) -> tuple[Inode, Inode | None]:
        """Atomically moves (parent, name) to (new_parent, new_name), replacing a target.
        Returns (moved inode, replaced inode or None)."""
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL, f"unknown rename flags {flags:#x}")
        check_name(new_name)
        node = self.lookup(parent_ino, name)
        parent = self.inodes[parent_ino]
        new_parent = self.directory(new_parent_ino)
        if new_parent.nlink == 0:
            raise FsError(errno.ENOENT, "target directory was removed")
        entry = new_parent.children.get(new_name)
        target = self.inodes[entry[1]] if entry else None
        if target is node:
            return node, None
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir and target.children:
                raise FsError(errno.ENOTEMPTY)
        if node.is_dir:  # a directory cannot move below itself
            up = new_parent
            while up is not None:
                if up is node:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                up = self.inodes.get(up.parent) if up.parent is not None else None
        if target is not None:
            self._unlink_entry(new_parent, new_name)
            if target.is_dir:
                target.nlink = 0
                del self.inodes[target.ino]
        self._unlink_entry(parent, name)
        self._link(new_parent, new_name, node)
        now = self.clock()
        self._touch_dir(parent, now)
        self._touch_dir(new_parent, now)
        node.ctime_ns = now
        if target is not None:
            target.ctime_ns = now
        return node, target
