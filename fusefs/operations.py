"""pyfuse3 Operations: the kernel's requests, served by a `Cache`.

Thin on purpose: every POSIX rule lives in the cache daemon; this class translates requests,
keeps the kernel's caches honest (timeouts, lookup counts, invalidation), and turns every
failure into the errno the kernel gets (errors.py, shared with inplace.py and ioctl.py).
"""

import errno
import functools
import logging
import os
import stat
from dataclasses import dataclass

import pyfuse3
import trio

from .cache import Attr, Cache
from .errors import errno_for, errno_for_xattr
from .passthrough import Passthrough

log = logging.getLogger("fusefs")

# Regular files carry no page cache in the host: the bytes live in the cache tier, and caching
# them again in host RAM would spend the memory offloading is meant to save. It also makes
# 1 MiB requests go straight to the daemon (faster for this workload than readahead).
DIRECT_IO = True

# A listing starts with `.` and `..` (as on tmpfs: `ls -a` shows them; readdir(3) callers such
# as os.listdir drop them): the kernel's offsets 1 and 2 follow them, the cache's entries
# follow at their cookie + DOTS, so every offset stays valid for as long as the entry exists.
DOTS = 2


CAP_FSETID = 4   # linux/capability.h


def _holds_fsetid(ctx) -> bool:
    """Whether the process behind a request holds CAP_FSETID (its writes and truncates keep
    set-user-ID and set-group-ID bits). Read from /proc; where that cannot be, root is taken
    to hold it and everyone else not."""
    try:
        with open(f"/proc/{ctx.pid}/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_FSETID & 1)
    except (OSError, ValueError, IndexError):
        pass
    return ctx.uid == 0


def mode_after_unprivileged_write(mode: int) -> int:
    """A file's mode once written or truncated by a user without CAP_FSETID: S_ISUID goes,
    and S_ISGID when group-executable (bluecached applies the same rule to writes)."""
    kill = mode & stat.S_ISUID
    if mode & stat.S_IXGRP:
        kill |= mode & stat.S_ISGID
    return mode & ~kill


def _boundary(handler):
    """Maps a handler's failures to FUSEError: an exception escaping a pyfuse3 handler would end
    the whole mount."""
    @functools.wraps(handler)
    async def serve(self, *args):
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            err = errno_for(e)
            if err == errno.EIO:
                log.warning("%s: %s -> EIO", handler.__name__, e)
            raise pyfuse3.FUSEError(err) from None
        except trio.Cancelled:
            raise
        except Exception:
            log.exception("internal error in %s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return serve


@dataclass
class Timeouts:
    """How long the kernel may trust what it was told (seconds).

    Positive entries and attributes: 60 s. Files are written once under content-hash names;
    the only other change is the cache removing a file, and hostd invalidates the kernel's
    entry and inode when the daemon announces that. Negative entries: 2 s. A name created on
    this mount replaces the negative entry at once; a name made elsewhere (another host
    sharing the remote tier, bluecachectl) shows up within 2 s, while a scheduler's burst of
    `os.path.exists` misses for one prefix is still answered by the kernel.
    """
    entry: float = 60.0
    attr: float = 60.0
    negative: float = 2.0


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False  # a write reaches the cache before write(2) returns
    enable_acl = False

    def __init__(self, cache: Cache, timeouts: Timeouts | None = None,
                 passthrough: Passthrough | None = None):
        """`passthrough`: read-only opens served by the kernel from the cache's backing file
        where it can be had (passthrough.py); None: every read reaches the cache."""
        super().__init__()
        self.cache = cache
        self.timeouts = timeouts or Timeouts()
        self.passthrough = passthrough
        self.lookups: dict[int, int] = {}   # what the kernel holds a reference to

    # -- helpers ---------------------------------------------------------------------------

    def _entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = attr.ino
        e.generation = 0  # inode numbers are never reused (the daemon prefixes its boot count)
        e.st_mode = attr.mode
        e.st_nlink = attr.nlink
        e.st_uid = attr.uid
        e.st_gid = attr.gid
        e.st_size = attr.size
        e.st_rdev = attr.rdev
        e.st_blksize = 1 << 20
        # a symlink's size is its target's length, held in the index: no blocks
        e.st_blocks = -(-attr.size // 512) if stat.S_ISREG(attr.mode) else 0
        e.st_atime_ns = attr.atime_ns
        e.st_mtime_ns = attr.mtime_ns
        e.st_ctime_ns = attr.ctime_ns
        e.entry_timeout = self.timeouts.entry
        e.attr_timeout = self.timeouts.attr
        return e

    def _remember(self, attr: Attr) -> pyfuse3.EntryAttributes:
        self.lookups[attr.ino] = self.lookups.get(attr.ino, 0) + 1
        return self._entry(attr)

    def _file_info(self, fh: int, flags: int) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=fh, direct_io=DIRECT_IO or bool(flags & os.O_DIRECT),
                                keep_cache=False)

    # -- lookups and attributes ------------------------------------------------------------

    @_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            attr = await self.cache.lookup(parent_inode, name)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0           # a cacheable "no such name"
            negative.entry_timeout = self.timeouts.negative
            return negative
        return self._remember(attr)

    async def forget(self, inode_list):
        # The cache keeps a removed file openable while the kernel holds it (rename-replace
        # is atomic for a path lookup racing it): tell it what the kernel let go.
        for ino, count in inode_list:
            left = self.lookups.get(ino, 0) - count
            if left > 0:
                self.lookups[ino] = left
            else:
                self.lookups.pop(ino, None)
        try:
            await self.cache.forget(list(inode_list))
        except OSError as e:  # forget has no reply: nothing to tell the kernel
            log.debug("forget not delivered: %s", e)

    @_boundary
    async def getattr(self, inode, ctx=None):
        return self._entry(await self.cache.getattr(inode))

    @_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        changes = {}
        if fields.update_size:
            changes["size"] = attr.st_size
        if fields.update_mode:
            changes["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:   # pyfuse3 already turned UTIME_NOW into the current time
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        return self._entry(await self.cache.setattr(inode, **changes))

    @_boundary
    async def statfs(self, ctx):
        s = await self.cache.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s["bsize"]
        out.f_frsize = s["frsize"]
        out.f_blocks = s["blocks"]
        out.f_bfree = s["bfree"]
        out.f_bavail = s["bavail"]
        out.f_files = s["files"]
        out.f_ffree = s["ffree"]
        out.f_favail = s["ffree"]
        out.f_namemax = s["namemax"]
        return out

    # -- directories -----------------------------------------------------------------------

    @_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._remember(await self.cache.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_boundary
    async def rmdir(self, parent_inode, name, ctx):
        await self.cache.rmdir(parent_inode, name)

    @_boundary
    async def unlink(self, parent_inode, name, ctx):
        await self.cache.unlink(parent_inode, name)

    @_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.cache.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_boundary
    async def opendir(self, inode, ctx):
        return inode

    @staticmethod
    def _dot(ino: int) -> pyfuse3.EntryAttributes:
        """`.` or `..`: the kernel takes only the inode number and type from these (it links
        no dentry for them, so they are no reference: fs/fuse/readdir.c)."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.st_mode = stat.S_IFDIR
        return e

    @_boundary
    async def readdir(self, fh, start_id, token):
        offset = max(0, start_id - DOTS)
        while True:
            parent, entries = await self.cache.readdir(fh, offset, 256)
            dots = [(b".", fh), (b"..", parent)][start_id:]
            for i, (name, ino) in enumerate(dots, start_id + 1):
                if not pyfuse3.readdir_reply(token, name, self._dot(ino), i):
                    if entries:
                        await self.cache.forget([(a.ino, 1) for _, a, _ in entries])
                    return
                start_id = i
            if not entries:
                return
            for i, (name, attr, cookie) in enumerate(entries):
                # READDIRPLUS: each accepted entry is a lookup the kernel will forget later;
                # the cache counted all it sent, so return the ones the kernel did not take.
                if not pyfuse3.readdir_reply(token, name, self._entry(attr), cookie + DOTS):
                    await self.cache.forget([(a.ino, 1) for _, a, _ in entries[i:]])
                    return
                self.lookups[attr.ino] = self.lookups.get(attr.ino, 0) + 1
                offset = cookie

    async def releasedir(self, fh):
        pass

    # -- files -----------------------------------------------------------------------------

    @_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, attr = await self.cache.create(parent_inode, name, mode, ctx.uid, ctx.gid, flags)
        await self._backed(attr, fh, flags)   # an existing file's create is an open of it
        return self._file_info(fh, flags), self._remember(attr)

    @_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):   # FIFOs, sockets, devices: attributes only, in the index
            return self._remember(await self.cache.mknod(parent_inode, name, mode, rdev,
                                                         ctx.uid, ctx.gid))
        fh, attr = await self.cache.create(parent_inode, name, mode, ctx.uid, ctx.gid,
                                           os.O_WRONLY | os.O_EXCL)
        await self.cache.release(fh)
        return self._remember(attr)

    @_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        return self._remember(await self.cache.symlink(parent_inode, name, target, ctx.uid,
                                                       ctx.gid))

    @_boundary
    async def readlink(self, inode, ctx):
        return await self.cache.readlink(inode)

    @_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._remember(await self.cache.link(inode, new_parent_inode, new_name))

    @_boundary
    async def open(self, inode, flags, ctx):
        fh, attr = await self.cache.open(inode, flags)
        if flags & os.O_TRUNC and mode_after_unprivileged_write(attr.mode) != attr.mode:
            await self._truncated_by(fh, inode, attr.mode, ctx)
        await self._backed(attr, fh, flags)
        return self._file_info(fh, flags)

    async def _backed(self, attr: Attr, fh: int, flags: int) -> None:
        if self.passthrough is None or not stat.S_ISREG(attr.mode):
            return
        try:
            await self.passthrough.opened(self.cache, attr.ino, fh, flags)
        except BaseException:
            await self.cache.release(fh)   # the kernel never hears of this handle
            raise

    async def _truncated_by(self, fh: int, inode: int, mode: int, ctx) -> None:
        """open(O_TRUNC) of a set-user-ID or set-group-ID file: the open did the truncation
        (FUSE_ATOMIC_O_TRUNC), so the kernel sends no setattr that would clear those bits, as
        truncate(2) would for a caller without CAP_FSETID. Rare: costs nothing otherwise."""
        if _holds_fsetid(ctx):
            return
        try:
            await self.cache.setattr(inode, mode=stat.S_IMODE(mode_after_unprivileged_write(mode)))
        except BaseException:
            await self.cache.release(fh)   # the kernel never hears of this handle
            raise

    @_boundary
    async def read(self, fh, off, size):
        return await self.cache.read(fh, off, size)

    @_boundary
    async def write(self, fh, off, buf):
        return await self.cache.write(fh, off, buf)

    @_boundary
    async def flush(self, fh):
        await self.cache.flush(fh)

    @_boundary
    async def fsync(self, fh, datasync):
        await self.cache.fsync(fh)

    @_boundary
    async def release(self, fh):
        if self.passthrough is not None:
            self.passthrough.released(fh)
        await self.cache.release(fh)

    # -- extended attributes ----------------------------------------------------------------
    # Only `user.` names reach the cache. Every other namespace is EOPNOTSUPP, answered here:
    # the kernel asks for `security.capability` before writes that may drop privileges, and
    # that must not cost a round trip to the cache daemon. The kernel (default_permissions)
    # checks read or write permission, and refuses user.* on symlinks and special files,
    # before a request comes; the name and size limits too (255 bytes, 64 KiB). pyfuse3
    # turns XATTR_CREATE and XATTR_REPLACE into a getxattr before the setxattr.
    # Locks are not implemented here: the kernel then keeps flock/fcntl locks local to this
    # host, which is what the connectors (who never lock) need.

    async def _xattr(self, method: str, *args):
        call = getattr(self.cache, method, None)
        if call is None:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        try:
            return await call(*args)
        except OSError as e:
            err = errno_for_xattr(e)
            if err == errno.EIO:
                log.warning("%s: %s -> EIO", method, e)
            raise pyfuse3.FUSEError(err) from None

    @staticmethod
    def _user_only(name: bytes) -> None:
        if not name.startswith(b"user."):
            raise pyfuse3.FUSEError(errno.ENOTSUP)

    @_boundary
    async def setxattr(self, inode, name, value, ctx):
        self._user_only(name)
        await self._xattr("setxattr", inode, name, value)

    @_boundary
    async def getxattr(self, inode, name, ctx):
        self._user_only(name)
        return await self._xattr("getxattr", inode, name)

    @_boundary
    async def listxattr(self, inode, ctx):
        return await self._xattr("listxattr", inode)

    @_boundary
    async def removexattr(self, inode, name, ctx):
        self._user_only(name)
        await self._xattr("removexattr", inode, name)

    # -- invalidation (called by hostd when the cache removes a file) ----------------------

    def forget_name(self, parent: int, name: bytes, ino: int) -> None:
        """The cache removed (parent, name): the kernel must miss on the next lookup."""
        pyfuse3.invalidate_entry_async(parent, name, deleted=ino, ignore_enoent=True)

    def forget_attributes(self, ino: int) -> None:
        """The cache changed a file's size or bytes behind the kernel (a zero-copy STORE):
        its next stat, lseek(SEEK_END) or read past the cached EOF asks again. Attributes
        only: dropping pages waits on page locks a read in flight may hold, and that read
        waits on this very event loop for its answer."""
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError:
            pass  # the kernel holds no such inode: nothing cached

    def forget_everything(self) -> None:
        """The cache restarted: attributes the kernel holds may describe files that are gone."""
        for ino in list(self.lookups):
            try:
                pyfuse3.invalidate_inode(ino, attr_only=True)
            except OSError:
                pass  # the kernel already dropped it
