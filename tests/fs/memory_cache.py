"""An in-memory `fusefs.Cache`: the daemon's answers without a daemon, for driving Operations.

Keeps what the tests look at: the references handed out per inode (each entry returned by
lookup, mkdir, create, ... and every READDIRPLUS entry is one, given back by forget, as in
bluecached), open handles, and failures to inject (`fail`).
"""

import errno
import os
import stat
from collections import Counter
from dataclasses import dataclass, field

from fusefs.cache import Attr

ROOT = 1
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


@dataclass
class Node:
    ino: int
    mode: int
    uid: int = 0
    gid: int = 0
    nlink: int = 1
    rdev: int = 0
    data: bytearray = field(default_factory=bytearray)
    target: bytes = b""                                     # a symlink's
    entries: dict[bytes, int] = field(default_factory=dict)  # a directory's names
    cookies: dict[bytes, int] = field(default_factory=dict)  # ... and their readdir cookies
    next_cookie: int = 1
    parent: int = ROOT
    time_ns: int = 0
    memfd: int | None = None   # the bytes again, once a backing was asked for (kept in step)

    def attr(self) -> Attr:
        size = len(self.target) if stat.S_ISLNK(self.mode) else len(self.data)
        return Attr(self.ino, self.mode, self.nlink, self.uid, self.gid, size, self.time_ns,
                    self.time_ns, self.time_ns, self.rdev)


def _fail(err: int, why: str) -> OSError:
    return OSError(err, why)


class MemoryCache:
    def __init__(self):
        self.nodes = {ROOT: Node(ROOT, stat.S_IFDIR | 0o755, nlink=2)}
        self.next_ino = ROOT + 1
        self.handles: dict[int, tuple[int, int]] = {}   # fh: (ino, flags)
        self.next_fh = 1
        self.refs: Counter = Counter()   # references handed out and not yet forgotten
        self.failures: dict[str, BaseException] = {}
        self.calls: list[str] = []

    def fail(self, op: str, error: BaseException) -> None:
        """The next call of `op` raises `error`."""
        self.failures[op] = error

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if op in self.failures:
            raise self.failures.pop(op)

    # -- helpers ---------------------------------------------------------------------------

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise _fail(errno.ENOENT, f"no inode {ino}") from None

    def _dir(self, ino: int) -> Node:
        node = self._node(ino)
        if not stat.S_ISDIR(node.mode):
            raise _fail(errno.ENOTDIR, f"inode {ino} is not a directory")
        return node

    def _child(self, parent: int, name: bytes) -> Node:
        ino = self._dir(parent).entries.get(name)
        if ino is None:
            raise _fail(errno.ENOENT, f"no {name!r} in {parent}")
        return self.nodes[ino]

    def _referenced(self, node: Node) -> Attr:
        self.refs[node.ino] += 1
        return node.attr()

    def _add(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **kw) -> Node:
        directory = self._dir(parent)
        if len(name) > 255:
            raise _fail(errno.ENAMETOOLONG, "name too long")
        if name in directory.entries:
            raise _fail(errno.EEXIST, f"{name!r} exists")
        node = Node(self.next_ino, mode, uid, gid, **kw)
        self.next_ino += 1
        self.nodes[node.ino] = node
        self._link_name(directory, name, node.ino)
        return node

    @staticmethod
    def _link_name(directory: Node, name: bytes, ino: int) -> None:
        directory.entries[name] = ino
        directory.cookies[name] = directory.next_cookie
        directory.next_cookie += 1

    def _drop_name(self, directory: Node, name: bytes) -> None:
        ino = directory.entries.pop(name)
        del directory.cookies[name]
        node = self.nodes[ino]
        node.nlink -= 2 if stat.S_ISDIR(node.mode) else 1
        if stat.S_ISDIR(node.mode):
            directory.nlink -= 1
        self._collect(node)

    def _collect(self, node: Node) -> None:
        """A node without names or open handles goes (the real cache also waits for the
        kernel's references; these tests look at those through `refs`)."""
        open_inos = {ino for ino, _ in self.handles.values()}
        if node.nlink <= 0 and node.ino not in open_inos:
            self.nodes.pop(node.ino, None)
            if node.memfd is not None:
                os.close(node.memfd)
                node.memfd = None

    @staticmethod
    def _resized(node: Node) -> None:
        if node.memfd is not None:
            os.ftruncate(node.memfd, len(node.data))

    def _open(self, node: Node, flags: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = (node.ino, flags)
        if flags & os.O_TRUNC:
            node.data.clear()
            self._resized(node)
        return fh

    def _handle(self, fh: int) -> tuple[Node, int]:
        try:
            ino, flags = self.handles[fh]
        except KeyError:
            raise _fail(errno.EBADF, f"no open file {fh}") from None
        return self.nodes[ino], flags

    # -- the Cache interface ---------------------------------------------------------------

    async def lookup(self, parent, name):
        self._enter("lookup")
        return self._referenced(self._child(parent, name))

    async def getattr(self, ino):
        self._enter("getattr")
        return self._node(ino).attr()

    async def setattr(self, ino, **changes):
        self._enter("setattr")
        node = self._node(ino)
        if "size" in changes:
            size = changes.pop("size")
            del node.data[size:]
            node.data.extend(bytes(size - len(node.data)))
            self._resized(node)
        if "mode" in changes:
            node.mode = stat.S_IFMT(node.mode) | changes.pop("mode")
        for key in ("uid", "gid"):
            if key in changes:
                setattr(node, key, changes.pop(key))
        changes.pop("atime_ns", None)
        if "mtime_ns" in changes:
            node.time_ns = changes.pop("mtime_ns")
        assert not changes, f"setattr of unknown fields {changes}"
        return node.attr()

    async def mkdir(self, parent, name, mode, uid, gid):
        self._enter("mkdir")
        node = self._add(parent, name, stat.S_IFDIR | mode, uid, gid, nlink=2)
        node.parent = parent
        self.nodes[parent].nlink += 1
        return self._referenced(node)

    async def create(self, parent, name, mode, uid, gid, flags):
        self._enter("create")
        try:
            node = self._child(parent, name)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            node = self._add(parent, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        else:
            if flags & os.O_EXCL:
                raise _fail(errno.EEXIST, f"{name!r} exists") from None
        return self._open(node, flags), self._referenced(node)

    async def symlink(self, parent, name, target, uid, gid):
        self._enter("symlink")
        return self._referenced(self._add(parent, name, stat.S_IFLNK | 0o777, uid, gid,
                                          target=target))

    async def mknod(self, parent, name, mode, rdev, uid, gid):
        self._enter("mknod")
        return self._referenced(self._add(parent, name, mode, uid, gid, rdev=rdev))

    async def readlink(self, ino):
        self._enter("readlink")
        node = self._node(ino)
        if not stat.S_ISLNK(node.mode):
            raise _fail(errno.EINVAL, "not a symlink")
        return node.target

    async def link(self, ino, new_parent, new_name):
        self._enter("link")
        node = self._node(ino)
        if stat.S_ISDIR(node.mode):
            raise _fail(errno.EPERM, "hard link to a directory")
        directory = self._dir(new_parent)
        if new_name in directory.entries:
            raise _fail(errno.EEXIST, f"{new_name!r} exists")
        self._link_name(directory, new_name, ino)
        node.nlink += 1
        return self._referenced(node)

    async def open(self, ino, flags):
        self._enter("open")
        node = self._node(ino)
        if stat.S_ISDIR(node.mode) and flags & os.O_ACCMODE != os.O_RDONLY:
            raise _fail(errno.EISDIR, "a directory")
        if not stat.S_IMODE(node.mode):
            # root passes the kernel's permission check: a way for mount tests to have an
            # OPEN answered with an error
            raise _fail(errno.EACCES, "mode 000: this test double refuses to open it")
        return self._open(node, flags), node.attr()

    async def read(self, fh, offset, size):
        self._enter("read")
        node, flags = self._handle(fh)
        if flags & os.O_ACCMODE == os.O_WRONLY:
            raise _fail(errno.EBADF, "not open for reading")
        return bytes(node.data[offset:offset + size])

    async def write(self, fh, offset, data):
        self._enter("write")
        node, flags = self._handle(fh)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            raise _fail(errno.EBADF, "not open for writing")
        if offset > len(node.data):
            node.data.extend(bytes(offset - len(node.data)))
        node.data[offset:offset + len(data)] = data
        if node.memfd is not None:   # in place, as on tmpfs: a backing's reader sees it
            os.pwrite(node.memfd, bytes(data), offset)
        return len(data)

    async def backing(self, fh):
        """The file's bytes in a memfd of its own (bluecached's DRAM tier keeps them so), a
        new fd for the caller to close: for a read-only handle of a file nobody has open for
        writing; None otherwise (bluecached's ENODATA)."""
        self._enter("backing")
        node, flags = self._handle(fh)
        writers = [f for ino, f in self.handles.values()
                   if ino == node.ino and f & os.O_ACCMODE != os.O_RDONLY]
        if flags & os.O_ACCMODE != os.O_RDONLY or writers or not stat.S_ISREG(node.mode):
            return None
        if node.memfd is None:
            node.memfd = os.memfd_create(f"ino-{node.ino}", os.MFD_CLOEXEC)
            os.pwrite(node.memfd, bytes(node.data), 0)
            self._resized(node)
        return os.dup(node.memfd), len(node.data)

    async def flush(self, fh):
        self._enter("flush")
        self._handle(fh)

    async def fsync(self, fh):
        self._enter("fsync")
        self._handle(fh)

    async def release(self, fh):
        self._enter("release")
        node, _ = self._handle(fh)
        del self.handles[fh]
        self._collect(node)

    async def unlink(self, parent, name):
        self._enter("unlink")
        node = self._child(parent, name)
        if stat.S_ISDIR(node.mode):
            raise _fail(errno.EISDIR, f"{name!r} is a directory")
        self._drop_name(self.nodes[parent], name)

    async def rmdir(self, parent, name):
        self._enter("rmdir")
        node = self._child(parent, name)
        if not stat.S_ISDIR(node.mode):
            raise _fail(errno.ENOTDIR, f"{name!r} is not a directory")
        if node.entries:
            raise _fail(errno.ENOTEMPTY, f"{name!r} is not empty")
        self._drop_name(self.nodes[parent], name)

    async def rename(self, parent, name, new_parent, new_name, flags):
        self._enter("rename")
        if flags & RENAME_EXCHANGE:
            raise _fail(errno.EINVAL, "RENAME_EXCHANGE is not implemented")
        node = self._child(parent, name)
        target_dir = self._dir(new_parent)
        replaced = target_dir.entries.get(new_name)
        if replaced == node.ino:
            return
        if replaced is not None:
            if flags & RENAME_NOREPLACE:
                raise _fail(errno.EEXIST, f"{new_name!r} exists")
            old = self.nodes[replaced]
            if stat.S_ISDIR(old.mode) != stat.S_ISDIR(node.mode):
                raise _fail(errno.EISDIR if stat.S_ISDIR(old.mode) else errno.ENOTDIR,
                            "rename across types")
            if old.entries:
                raise _fail(errno.ENOTEMPTY, f"{new_name!r} is not empty")
            self._drop_name(target_dir, new_name)
        source_dir = self.nodes[parent]
        del source_dir.entries[name], source_dir.cookies[name]
        self._link_name(target_dir, new_name, node.ino)
        if stat.S_ISDIR(node.mode) and parent != new_parent:
            node.parent = new_parent
            source_dir.nlink -= 1
            target_dir.nlink += 1

    async def readdir(self, ino, offset, limit):
        self._enter("readdir")
        directory = self._dir(ino)
        listed = sorted((cookie, name) for name, cookie in directory.cookies.items()
                        if cookie > offset)[:limit]
        out = []
        for cookie, name in listed:
            node = self.nodes[directory.entries[name]]
            out.append((name, self._referenced(node), cookie))
        return directory.parent, out

    async def statfs(self):
        self._enter("statfs")
        return {"bsize": 1 << 20, "frsize": 1 << 20, "blocks": 1024, "bfree": 1000,
                "bavail": 1000, "files": 1 << 20, "ffree": (1 << 20) - len(self.nodes),
                "namemax": 255}

    async def forget(self, counts):
        self._enter("forget")
        for ino, n in counts:
            self.refs[ino] -= n
            assert self.refs[ino] >= 0, f"inode {ino} forgotten more often than handed out"
            if not self.refs[ino]:
                del self.refs[ino]
