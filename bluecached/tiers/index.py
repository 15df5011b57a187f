"""The persistent index: what the journal's records mean, and rebuilding the namespace from them.

Records are small tuples keyed by inode number (docs/architecture.md lists them). Replay applies
them with the live namespace's own rules, so a replayed namespace is one the daemon could have
had: placing an inode where another one is drops the other (rename-replace).
"""

import logging
import stat
from dataclasses import dataclass, field

from .. import xattrs
from ..namespace import META_TYPES, ROOT_INO, Inode, Namespace
from .nvme import Extent

log = logging.getLogger("bluecached.tiers.index")

# Record tags (one letter: a million records should stay small).
BOOT = "B"    # (B, boot_number)                   inode numbers of this boot start at boot << 40
DIR = "D"     # (D, ino, parent, name, mode, uid, gid, atime, mtime, ctime)
FILE = "F"    # (F, ino, parent, name, mode, uid, gid, atime, mtime, ctime, size, off, len, crcs
              #  [, xattrs])   xattrs: [[name, value], ...], only when the file has some
MOVE = "M"    # (M, ino, parent, name)
ATTR = "A"    # (A, ino, mode, uid, gid, atime, mtime, ctime)
DROP = "X"    # (X, ino)
REMOTE = "R"  # (R, ino)   the file's persisted content is also in the remote tier
NODE = "N"    # (N, ino, parent, name, mode, uid, gid, atime, mtime, ctime, rdev, target)
              # a symlink (target: bytes) or a FIFO, socket or device node (rdev; target nil)
NAMES = "L"   # (L, ino, [[parent, name], ...])   every name of an inode with hard links
XATTRS = "Y"  # (Y, ino, [[name, value], ...])   a journaled inode's user.* attributes, all of them

INO_BOOT_SHIFT = 40  # 2**40 inode numbers per boot: never reused across restarts


def _attr_fields(node: Inode) -> tuple:
    return (node.mode, node.uid, node.gid, node.atime_ns, node.mtime_ns, node.ctime_ns)


def dir_record(node: Inode) -> tuple:
    return (DIR, node.ino, node.parent, node.name, *_attr_fields(node))


def file_record(node: Inode, extent: Extent | None, crcs: bytes) -> tuple:
    off, length = (extent.offset, extent.length) if extent else (0, 0)
    # the attributes travel with the content they were set on: one record, one append
    extra = (xattrs.to_pairs(node.xattrs),) if node.xattrs else ()
    return (FILE, node.ino, node.parent, node.name, *_attr_fields(node), node.size,
            off, length, crcs, *extra)


def node_record(node: Inode) -> tuple:
    return (NODE, node.ino, node.parent, node.name, *_attr_fields(node), node.rdev, node.target)


def names_record(node: Inode) -> tuple:
    return (NAMES, node.ino, [[p, n] for p, n in node.names()])


def place_record(node: Inode) -> tuple:
    """What says where a persisted inode is after a change of its names: MOVE while it has
    one name (which takes any other it had away on replay), NAMES while it has several."""
    return move_record(node) if node.extra is None else names_record(node)


def move_record(node: Inode) -> tuple:
    return (MOVE, node.ino, node.parent, node.name)


def attr_record(node: Inode) -> tuple:
    return (ATTR, node.ino, *_attr_fields(node))


def xattrs_record(node: Inode) -> tuple:
    return (XATTRS, node.ino, xattrs.to_pairs(node.xattrs))


def drop_record(ino: int) -> tuple:
    return (DROP, ino)


def remote_record(ino: int) -> tuple:
    return (REMOTE, ino)


@dataclass
class Replayed:
    """What replay found: the persisted files' placement on NVMe, and the boot counter."""
    boot: int = 0
    files: dict[int, tuple[int, Extent | None, bytes]] = field(default_factory=dict)
    remote: set[int] = field(default_factory=set)   # files whose content is also remote
    skipped: int = 0


_KINDS = {DIR: {stat.S_IFDIR}, FILE: {stat.S_IFREG}, NODE: META_TYPES}


class _Replayer:
    def __init__(self, ns: Namespace):
        self.ns = ns
        self.out = Replayed()

    def drop(self, ino: int) -> None:
        node = self.ns.inodes.get(ino)
        if node is None or ino == ROOT_INO:
            return
        if node.is_dir:  # its children were dropped before it, or the log is damaged
            for name, (_, child) in list(node.children.items()):
                self._take(child, ino, name)   # a file with a name elsewhere keeps that
        for parent_ino, name in node.names():
            self.ns._unlink_entry(self.ns.inodes[parent_ino], name)
        self.ns.inodes.pop(ino, None)
        self.out.files.pop(ino, None)
        self.out.remote.discard(ino)

    def _take(self, ino: int, parent_ino: int, name: bytes) -> None:
        """Rename-replace: the inode that holds (parent, name) loses it; gone if it was its
        last name."""
        node = self.ns.inodes[ino]
        if len(node.names()) > 1:
            self.ns._unlink_entry(self.ns.inodes[parent_ino], name)
        else:
            self.drop(ino)

    def place(self, node: Inode, names: list[tuple[int, bytes]]) -> bool:
        """The inode's names become `names` (each a directory's entry), taken from whoever
        holds them. False if none is left: the inode is dropped."""
        valid = []
        for parent_ino, name in names:
            parent = self.ns.inodes.get(parent_ino)
            if parent is None or not parent.is_dir:
                self.out.skipped += 1
                log.warning("index: inode %d names missing directory %d; dropped", node.ino,
                            parent_ino)
            else:
                valid.append((parent_ino, name))
        if not valid:
            self.drop(node.ino)
            return False
        for parent_ino, name in node.names():
            if (parent_ino, name) not in valid:
                self.ns._unlink_entry(self.ns.inodes[parent_ino], name)
        for parent_ino, name in valid:
            if (parent_ino, name) in node.names():
                continue
            parent = self.ns.inodes[parent_ino]
            held = parent.children.get(name)
            if held is not None:
                self._take(held[1], parent_ino, name)
            self.ns._link(parent, name, node)
        return True

    @staticmethod
    def _attrs(node: Inode, fields) -> None:
        mode, uid, gid, atime, mtime, ctime = fields
        node.mode, node.uid, node.gid = mode, uid, gid
        node.atime_ns, node.mtime_ns, node.ctime_ns = atime, mtime, ctime

    def apply(self, rec) -> None:
        tag = rec[0]
        if tag == BOOT:
            self.out.boot = max(self.out.boot, rec[1])
        elif tag in (DIR, FILE, NODE):
            ino, parent, name = rec[1:4]
            if ino == ROOT_INO:
                # the root has no (parent, name): the store journals its setattr as DIR(root)
                if tag != DIR:
                    raise ValueError(f"a {tag} record for the root")
                self._attrs(self.ns.inodes[ROOT_INO], rec[4:10])
                return
            kind = stat.S_IFMT(rec[4])
            if kind not in _KINDS[tag]:
                raise ValueError(f"file type {kind:#o} in a {tag} record")
            if tag == NODE and (kind == stat.S_IFLNK) != isinstance(rec[11], bytes):
                raise ValueError("a symlink's NODE record without a target, or another's with one")
            table = xattrs.from_pairs(rec[14]) if tag == FILE and len(rec) > 14 else None
            node = self.ns.inodes.get(ino)
            if node is None or stat.S_IFMT(node.mode) != kind:
                if node is not None:
                    self.drop(ino)
                node = Inode(ino, rec[4], rec[5], rec[6], rec[9])
                self.ns.inodes[ino] = node
            self._attrs(node, rec[4:10])
            if tag == NODE:
                node.rdev, node.target = rec[10], rec[11]
                node.size = len(node.target) if node.target is not None else 0
            if not self.place(node, [(parent, name)]):
                return
            if tag == FILE:
                size, off, length, crcs = rec[10:14]
                node.size = size
                node.xattrs = table   # new content: exactly the attributes recorded with it
                self.out.files[ino] = (size, Extent(off, length) if length else None, crcs)
                self.out.remote.discard(ino)   # new content: not the one uploaded
        elif tag == MOVE:
            node = self.ns.inodes.get(rec[1])
            self.out.remote.discard(rec[1])   # the remote copy is under the old name
            if node is not None:
                self.place(node, [(rec[2], rec[3])])
        elif tag == NAMES:
            names = [(p, n) for p, n in rec[2]]
            if not names or not all(type(p) is int and type(n) is bytes for p, n in names):
                raise ValueError("a NAMES record without a list of (parent, name)")
            node = self.ns.inodes.get(rec[1])
            self.out.remote.discard(rec[1])   # a file with several names is not uploaded
            if node is not None:
                if node.is_dir:
                    raise ValueError("a NAMES record for a directory")
                self.place(node, names)
        elif tag == ATTR:
            node = self.ns.inodes.get(rec[1])
            if node is not None:
                self._attrs(node, rec[2:8])
        elif tag == XATTRS:
            node = self.ns.inodes.get(rec[1])
            table = xattrs.from_pairs(rec[2])
            if node is not None:
                node.xattrs = table
                self.out.remote.discard(rec[1])   # the remote copy has the attributes before
        elif tag == DROP:
            self.drop(rec[1])
        elif tag == REMOTE:
            if rec[1] in self.out.files:
                self.out.remote.add(rec[1])
        else:
            self.out.skipped += 1
            log.warning("index: unknown record %r ignored", tag)


def replay(ns: Namespace, records) -> Replayed:
    """Rebuilds `ns` (a fresh namespace) from records. Files become inodes without data; the
    caller attaches their NVMe placement from the result."""
    r = _Replayer(ns)
    for rec in records:
        try:
            r.apply(rec)
        except (ValueError, TypeError, IndexError, KeyError) as e:
            r.out.skipped += 1
            log.warning("index: malformed record %.80r ignored (%s)", rec, e)
    return r.out


def snapshot_records(ns: Namespace, persisted: dict[int, tuple[Extent | None, bytes]],
                     boot: int, remote: set[int] = frozenset()) -> list:
    """The records that rebuild the current persisted state: directories before their
    children, only files whose current content is on NVMe, every symlink and special file.
    The root is always there: only its attributes are recorded (an operator's chown or chmod
    of the mount)."""
    out = [(BOOT, boot), attr_record(ns.inodes[ROOT_INO])]
    if ns.inodes[ROOT_INO].xattrs:
        out.append(xattrs_record(ns.inodes[ROOT_INO]))
    linked = []   # inodes with several names: after every directory they are in
    for node in ns.walk():
        if node.ino == ROOT_INO:
            continue
        if node.is_dir:
            out.append(dir_record(node))
            if node.xattrs:
                out.append(xattrs_record(node))
        elif node.extra is not None:
            linked.append(node)
        else:
            out += _inode_records(node, persisted, remote)
    for node in linked:
        records = _inode_records(node, persisted, remote)
        if records:
            out += [*records, names_record(node)]
    return out


def _inode_records(node: Inode, persisted: dict, remote: set[int]) -> list:
    if node.is_meta:
        return [node_record(node)]
    if node.ino not in persisted:
        return []
    extent, crcs = persisted[node.ino]
    out = [file_record(node, extent, crcs)]
    if node.ino in remote:
        out.append(remote_record(node.ino))
    return out
