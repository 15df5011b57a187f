"""The kernel's side of the FUSE session, played in-process: each request is one call of an
Operations handler under trio, as pyfuse3 makes it, with a request context of our choosing.

Keeps the references the kernel holds (one per entry it was given, as fs/fuse counts
nlookup), so a test can give them all back with FORGET, as the kernel does when it evicts.
"""

import os
import stat
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pyfuse3
import trio

from fusefs import Operations, Timeouts

ROOT = 1
TIMEOUTS = Timeouts(entry=11.0, attr=12.0, negative=3.0)   # apart, to tell them apart


def ctx(uid: int = 0, gid: int = 0, pid: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(uid=uid, gid=gid, pid=os.getpid() if pid is None else pid, umask=0o22)


def setattr_fields(**given) -> SimpleNamespace:
    names = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid",
             "update_gid", "update_size")
    return SimpleNamespace(**{name: given.get(name, False) for name in names})


class Kernel:
    def __init__(self, ops: Operations):
        self.ops = ops
        self.held: Counter = Counter()   # the kernel's nlookup per inode

    def call(self, handler: str, *args):
        """One request: its reply, or the pyfuse3.FUSEError the kernel would get."""
        return trio.run(getattr(self.ops, handler), *args, strict_exception_groups=True)

    def _entry(self, entry: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        if entry.st_ino:   # a negative entry is no reference
            self.held[entry.st_ino] += 1
        return entry

    def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        return self._entry(self.call("lookup", parent, name, ctx()))

    def mkdir(self, parent: int, name: bytes, mode: int = 0o755) -> pyfuse3.EntryAttributes:
        return self._entry(self.call("mkdir", parent, name, stat.S_IFDIR | mode, ctx()))

    def create(self, parent: int, name: bytes, mode: int = 0o644,
               flags: int = os.O_RDWR | os.O_CREAT) -> tuple[pyfuse3.FileInfo,
                                                            pyfuse3.EntryAttributes]:
        info, entry = self.call("create", parent, name, stat.S_IFREG | mode, flags, ctx())
        return info, self._entry(entry)

    def symlink(self, parent: int, name: bytes, target: bytes) -> pyfuse3.EntryAttributes:
        return self._entry(self.call("symlink", parent, name, target, ctx()))

    def link(self, ino: int, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        return self._entry(self.call("link", ino, parent, name, ctx()))

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int = 0) -> pyfuse3.EntryAttributes:
        return self._entry(self.call("mknod", parent, name, mode, rdev, ctx()))

    def write_file(self, parent: int, name: bytes, data: bytes) -> int:
        """create, write, flush, release: the file's inode."""
        info, entry = self.create(parent, name)
        assert self.call("write", info.fh, 0, data) == len(data)
        self.call("flush", info.fh)
        self.call("release", info.fh)
        return entry.st_ino

    def readdir(self, ino: int, start: int = 0,
                room: int | None = None) -> list[tuple[bytes, pyfuse3.EntryAttributes, int]]:
        """One READDIRPLUS with room for `room` entries (None: all): (name, attributes,
        offset of the next) of each entry taken. Taken entries other than . and .. are
        references."""
        taken = []

        def reply(token, name, attr, next_id):
            if room is not None and len(taken) == room:
                return False
            taken.append((name, attr, next_id))
            return True

        with mock.patch.object(pyfuse3, "readdir_reply", reply):
            self.call("readdir", ino, start, object())
        for name, attr, _ in taken:
            if name not in (b".", b".."):
                self.held[attr.st_ino] += 1
        return taken

    def list_all(self, ino: int, room: int | None = None) -> list[bytes]:
        """Every name in directory `ino`, page by page as the kernel asks for them."""
        names, offset = [], 0
        while page := self.readdir(ino, offset, room):
            names += [name for name, _, _ in page]
            offset = page[-1][2]
        return names

    def forget(self, counts: dict[int, int]) -> None:
        self.call("forget", list(counts.items()))
        self.held -= Counter(counts)

    def forget_all(self) -> None:
        """What the kernel does at unmount (or evicting everything): every reference back."""
        self.forget(dict(self.held))
