"""Serves the control protocol: decoded requests become Store calls, results become replies.

This is the one place where errors become errno values on the wire. Expected failures
(FsError, DmaError, ProtocolError) are replies; anything else is a bug: logged with its
traceback, answered with EIO, and the daemon keeps serving.
"""

import errno
import itertools
import logging
import os
import time

import trio

from . import __version__
from .dma import DmaError, RegionTable
from .log_limit import LogLimiter
from .namespace import FsError, Inode, mode_after_unprivileged_write
from .store import Store
from .wire import protocol
from .wire.zmqpump import SocketPump

BAD_MESSAGE_LOG_S = 60.0   # bad control messages are logged at most this often (and counted)

log = logging.getLogger("bluecached.server")


class Session:
    __slots__ = ("id", "client", "known", "last_seen", "local", "ended")

    def __init__(self, sid: int, client: str, local: bool = False):
        self.id = sid
        self.client = client
        self.local = local   # on the unix socket: replies may carry file descriptors
        self.last_seen = trio.current_time()
        self.known: dict[int, int] = {}   # inode -> entries sent and not yet forgotten
        self.ended = False   # replaced, silent or disconnected: what it holds was let go


class WithFd:
    """A result whose reply carries a file descriptor (SCM_RIGHTS), closed here once sent."""

    __slots__ = ("result", "fd")

    def __init__(self, result: dict, fd: int):
        self.result = result
        self.fd = fd


class ControlServer:
    def __init__(self, store: Store, regions: RegionTable, status, stats, verifier,
                 max_message_bytes: int = 65536, session_timeout: float = 120.0):
        self.store = store
        self.regions = regions
        self.status = status        # () -> dict
        self.stats = stats          # () -> dict
        self.verifier = verifier
        # never below what one setxattr of a 64 KiB value needs (docs/protocol.md)
        self.max_message_bytes = max(max_message_bytes, protocol.MIN_MESSAGE_BYTES)
        self.session_timeout = session_timeout
        self.incarnation = os.urandom(8).hex()
        self.sessions: dict[bytes, Session] = {}
        # Unique across restarts: a client reconnecting after one names its old session in
        # `replaces`, and a count from 1 would end whoever holds that number here (seen: a
        # bluecachectl session cut off by hostd's reconnect, "say hello first").
        self._session_ids = itertools.count(int.from_bytes(os.urandom(4), "big") << 20)
        self._bad_message_log = LogLimiter(BAD_MESSAGE_LOG_S)
        self.requests = 0
        self.bad_messages = 0
        self._peers: dict[bytes, object] = {}   # local SEQPACKET clients by identity
        self._pump: SocketPump | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, sock, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._pump = SocketPump(sock)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._expire_sessions)
            task_status.started()
            await self._pump.run(self._on_message)

    async def _expire_sessions(self) -> None:
        """ROUTER sockets do not say when a peer goes away: a client that crashed is noticed
        by its silence, and what it held (handles, kernel references) is let go."""
        while True:
            await trio.sleep(max(0.2, self.session_timeout / 4))
            cutoff = trio.current_time() - self.session_timeout
            for identity, session in list(self.sessions.items()):
                if session.last_seen < cutoff:
                    del self.sessions[identity]
                    released = self._end_session(session)
                    log.info("session %d (%s) silent for %gs: ended, %d handles released",
                             session.id, session.client, self.session_timeout, released)

    # -- receiving -------------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:  # ROUTER adds the identity; a client sends exactly one frame
            self.bad_messages += 1
            note = self._bad_message_log.allow()
            if note is not None:
                log.warning("dropped a control message with %d frames%s", len(frames), note)
            return
        self.on_frame(*frames)

    # -- local (SOCK_SEQPACKET) clients -----------------------------------------------------

    def attach_peer(self, peer) -> None:
        self._peers[peer.identity] = peer

    def detach_peer(self, peer) -> None:
        """A local client disconnected: what it held is let go now (zmq cannot tell us)."""
        self._peers.pop(peer.identity, None)
        session = self.sessions.pop(peer.identity, None)
        if session is not None:
            released = self._end_session(session)
            log.info("session %d (%s) disconnected; %d handles released", session.id,
                     session.client, released)

    def on_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            request = protocol.decode_request(frame, self.max_message_bytes)
        except protocol.ProtocolError as e:
            self.bad_messages += 1
            note = self._bad_message_log.allow()
            if note is not None:   # a client sending garbage must not flood the journal
                log.warning("bad control message (%d bytes): %s%s", len(frame), e, note)
            self._reply(identity, protocol.encode_error(e.request_id, e.errno, str(e)))
            return
        except Exception:  # a decoder bug must cost one message, not the daemon
            self.bad_messages += 1
            log.exception("decoding a control message of %d bytes failed", len(frame))
            self._reply(identity, protocol.encode_error(None, errno.EBADMSG, "undecodable"))
            return
        self.requests += 1
        self._nursery.start_soon(self._serve, identity, request)

    def _reply(self, identity: bytes, payload: bytes, fd: int | None = None) -> None:
        peer = self._peers.get(identity)
        if peer is not None:
            peer.send(payload, fd)
            return
        if fd is not None:
            os.close(fd)   # the client went away before its reply
        if not identity.startswith(b"local-"):
            self._pump.send([identity, payload])

    async def _serve(self, identity: bytes, request: protocol.Request) -> None:
        started = time.perf_counter()
        try:
            session = self.sessions.get(identity)
            if session is not None:
                session.last_seen = trio.current_time()
            if request.op == "hello":
                result = self._hello(identity, request.args)
            elif session is None:
                raise FsError(errno.EPROTO, "say hello first (version handshake)")
            else:
                if "fh" in request.args:
                    self._owned(session, request.args["fh"])
                try:
                    result = await getattr(self, "op_" + request.op)(session, **request.args)
                finally:
                    self._after_end(session, request.op)
        except (FsError, DmaError, protocol.ProtocolError) as e:
            self._reply(identity, protocol.encode_error(request.id, e.errno, str(e)))
        except Exception:
            log.exception("internal error serving %s", request.op)
            self._reply(identity, protocol.encode_error(request.id, errno.EIO, "internal error"))
        else:
            if isinstance(result, WithFd):
                self._reply(identity, protocol.encode_reply(request.id, result.result),
                            result.fd)
            else:
                self._reply(identity, protocol.encode_reply(request.id, result))
        finally:
            # log_level: debug shows where a request's time went (one line per request)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s served in %.3f ms", request.op,
                          (time.perf_counter() - started) * 1e3)

    def _after_end(self, session: Session, op: str) -> None:
        """A request that was still being served when its session ended (a reconnect's
        `replaces` while bluecached was stalled, a silent client) may have opened a handle,
        registered a region or given an entry after the session's holdings were let go.
        Nobody would release those, and an open handle keeps its object from eviction (a
        writer's, from being written behind): they are let go now too. The reply still goes
        out; a client that reconnected no longer listens for it."""
        if session.ended:
            released = self._end_session(session)
            if released:
                log.info("session %d had ended while its %s was served: %d handles released",
                         session.id, op, released)

    def _owned(self, session: Session, fh) -> None:
        """A handle is used only by the session that opened it: a client's stale number (one
        its last daemon gave, before a restart numbered handles from 1 again) must fail, not
        read, write or close another client's file. One the store does not know fails there."""
        handle = self.store.handles.get(fh) if isinstance(fh, int) else None
        if handle is not None and handle.session != session.id:
            raise FsError(errno.EBADF, f"handle {fh} was not opened by this session")

    # -- operations ------------------------------------------------------------------------

    def _known(self, session: Session, node: Inode) -> dict:
        """Attributes of an inode the client's kernel now holds a reference to (FUSE counts
        every entry it is given and forgets them later with the same counts)."""
        count = session.known.get(node.ino, 0)
        if not count:
            self.store.reference(node.ino)
        session.known[node.ino] = count + 1
        # A file a writer's kernel is writing: its size as of now, not as last seen (the
        # kernel takes a READDIRPLUS entry's size as the truth, too).
        self.store.observe(node)
        return node.attrs()

    def _end_session(self, session: Session) -> int:
        session.ended = True
        self.regions.remove_owner(session)
        released = self.store.release_session(session.id)
        for ino in session.known:
            self.store.unreference(ino)
        session.known.clear()
        return released

    def _hello(self, identity: bytes, args: dict) -> dict:
        common = [v for v in args["versions"] if v in protocol.SUPPORTED_VERSIONS]
        if not common:
            raise FsError(errno.EPROTO, f"no common protocol version: client speaks "
                                        f"{args['versions']}, daemon {protocol.SUPPORTED_VERSIONS}")
        old = args.get("replaces")
        if old is not None:
            for ident, sess in list(self.sessions.items()):
                if sess.id == old:
                    released = self._end_session(sess)
                    log.info("session %d replaced by a reconnect; released %d handles",
                             old, released)
                    del self.sessions[ident]
        previous = self.sessions.get(identity)
        if previous is not None:
            self._end_session(previous)
        session = Session(next(self._session_ids), args.get("client", ""),
                          local=identity in self._peers)
        self.sessions[identity] = session
        return {"version": max(common), "server": f"bluecached {__version__}",
                "incarnation": self.incarnation, "session": session.id,
                "engine": self.regions.engine.name,
                "max_message_bytes": self.max_message_bytes,
                "max_file_size": self.store.max_file_size,
                # optional arguments this daemon knows, for clients newer than the protocol
                # version they share with it
                "features": ["kill_suidgid", "backing", "open_backing", "xattrs",
                             "writer_backing", "open_kept", "open_prepared"]}

    async def op_ping(self, session) -> dict:
        return {}

    async def op_lookup(self, session, parent, name, prepare=False) -> dict:
        """A client on this host gets the open that may follow readied (Store.ready_open).
        With `prepare`, its reply may also carry `prepared`: a read-only open right after
        would be given nothing to lend, so the client may answer that open itself and send it
        here after. An NVMe hit read through the daemon then waits on this daemon once before
        its reads, not twice."""
        node = await self.store.find(parent, name)
        reply = self._known(session, node)
        if session.local:   # lent fds reach local clients only
            prepared = self.store.ready_open(node, session.id, prepare)
            if prepared is not None:
                reply["prepared"] = prepared
        return reply

    async def op_forget(self, session, inos, counts) -> dict:
        if len(inos) != len(counts):
            raise FsError(errno.EINVAL, "forget: inos and counts differ in length")
        for ino, n in zip(inos, counts, strict=True):
            left = session.known.get(ino, 0) - n
            if left > 0:
                session.known[ino] = left
            elif ino in session.known:
                del session.known[ino]
                self.store.unreference(ino)
        return {}

    async def op_getattr(self, session, ino) -> dict:
        return self.store.getattr(ino).attrs()

    async def op_setattr(self, session, ino, **changes) -> dict:
        return (await self.store.setattr(ino, **changes)).attrs()

    async def op_mkdir(self, session, parent, name, mode, uid, gid) -> dict:
        return self._known(session, self.store.mkdir(parent, name, mode, uid, gid))

    async def op_symlink(self, session, parent, name, target, uid, gid) -> dict:
        return self._known(session, self.store.symlink(parent, name, target, uid, gid))

    async def op_mknod(self, session, parent, name, mode, rdev, uid, gid) -> dict:
        return self._known(session, self.store.mknod(parent, name, mode, rdev, uid, gid))

    async def op_link(self, session, ino, new_parent, new_name) -> dict:
        return self._known(session, await self.store.link(ino, new_parent, new_name))

    async def op_readlink(self, session, ino) -> dict:
        return {"target": self.store.readlink(ino)}

    async def op_create(self, session, parent, name, mode, uid, gid, flags,
                        backing=False) -> dict | WithFd:
        """With `backing`, the new file's memfd comes too (as op_backing), for a writer's
        kernel to write it directly: a store then costs no request per write."""
        handle = await self.store.create(parent, name, mode, uid, gid, flags, session.id)
        result = {"fh": handle.fh, "attr": self._known(session, handle.node)}
        return await self._with_backing(session, handle, result) if backing else result

    async def op_open(self, session, ino, flags, backing=False, kept=None) -> dict | WithFd:
        """With `backing`, the open also brings the memfd (as op_backing), so that a hit
        costs hostd one round trip: the open is on every cache hit's path. With `kept`, the
        client already answered its kernel with the memfd it kept ([st_dev, st_ino]): the
        reply says whether that is still the object's (Store.keep)."""
        handle = await self.store.open(ino, flags, session.id)
        self.store.observe(handle.node)
        result = {"fh": handle.fh, "attr": handle.node.attrs()}
        if kept is not None:   # (its shape checked with the message: no handle for a bad one)
            result["kept"] = session.local and self.store.keep(handle.fh, kept)
        return await self._with_backing(session, handle, result) if backing else result

    async def _with_backing(self, session, handle, result: dict) -> dict | WithFd:
        if not session.local:
            return result
        try:
            lent = await self.store.backing_loaded(handle.fh)
        except FsError:
            # No memfd to give (ENODATA), or the promotion failed (EIO: a checksum mismatch
            # removed the object; ENOSPC): the open stands, and its reads and writes meet
            # what they meet without passthrough.
            return result
        reply = {**result, "backing_size": lent.size}
        if not lent.keepable:
            reply["backing_keep"] = False   # for this open's handles only
        return WithFd(reply, lent.fd)

    async def _transfer(self, method, fh, offset, length, region, region_offset) -> dict:
        reg = self.regions.acquire(region, region_offset, length)
        try:
            return {"length": await method(fh, offset, length, reg, region_offset)}
        finally:
            self.regions.done(reg)

    async def op_read(self, session, **args) -> dict:
        reply = await self._transfer(self.store.read, **args)
        handle = self.store.handles.get(args["fh"])
        if handle is not None:   # the size too: the ioctl's LOAD reports it (one round trip)
            reply["size"] = handle.node.size
        return reply

    async def _kill_suidgid(self, fh: int) -> None:
        """A write by a user without CAP_FSETID (FUSE_WRITE_KILL_SUIDGID, which hostd passes on)
        clears the file's set-user-ID bit, and its set-group-ID bit when group-executable,
        before the write, as a local file system does. Nothing to do (and no cost) otherwise."""
        handle = self.store.handles.get(fh)
        if handle is None or not handle.writable:
            return   # the write itself says why not
        node = handle.node
        mode = mode_after_unprivileged_write(node.mode)
        if mode != node.mode:
            await self.store.setattr(node.ino, mode=mode)

    async def op_write(self, session, kill_suidgid=False, **args) -> dict:
        if kill_suidgid:
            await self._kill_suidgid(args["fh"])
        return await self._transfer(self.store.write, **args)

    async def op_write_batch(self, session, region, fhs, offsets, lengths,
                             region_offsets, kill_suidgid=()) -> dict:
        """Writes, applied in list order, each answered apart: hostd sends the writes it
        answered once staged together (one message and one reply instead of one each), and
        one file's failure must not fail the others'."""
        if not fhs or not len(fhs) == len(offsets) == len(lengths) == len(region_offsets):
            raise FsError(errno.EINVAL, "write_batch: fhs, offsets, lengths and region_offsets "
                                        "must be non-empty lists of one length")
        total, failed = 0, []
        kills = set(kill_suidgid)
        for i, piece in enumerate(zip(fhs, offsets, lengths, region_offsets, strict=True)):
            fh, offset, length, region_offset = piece
            try:
                self._owned(session, fh)
                if i in kills:
                    await self._kill_suidgid(fh)
                total += (await self._transfer(self.store.write, fh, offset, length, region,
                                               region_offset))["length"]
            except (FsError, DmaError) as e:
                failed.append([i, e.errno, str(e)])
        return {"length": total, "failed": failed}

    async def op_store(self, session, fh, length, region, region_offset) -> dict:
        reg = self.regions.acquire(region, region_offset, length)
        try:
            n = await self.store.replace(fh, length, reg, region_offset)
        finally:
            self.regions.done(reg)
        return {"length": n, "size": n}

    async def op_query(self, session, fh) -> dict:
        crc, node = await self.store.checksum(fh)
        return {"size": node.size, "tier": self.store.tier_of(node), "crc32c": crc}

    async def op_flush(self, session, fh) -> dict:
        await self.store.flush(fh)
        return {}

    async def op_fsync(self, session, fh) -> dict:
        await self.store.fsync(fh)
        return {}

    async def op_backing(self, session, fh) -> WithFd:
        """The open file's memfd, for hostd to make it the FUSE passthrough backing file of
        this handle. ENODATA means "serve it through the daemon" (hostd then does as without
        passthrough; the open itself stands): an object not complete in DRAM, and every
        request over zmq, which carries no file descriptors (DPU mode: another machine)."""
        if not session.local:
            raise FsError(errno.ENODATA, "no backing: file descriptors pass only over the "
                                         "local unix socket")
        fd, size = self.store.backing(fh)
        return WithFd({"size": size}, fd)

    async def op_release(self, session, fh) -> dict:
        self.store.release(fh)
        return {}

    async def op_unlink(self, session, parent, name) -> dict:
        self.store.unlink(parent, name)
        return {}

    async def op_discard(self, session, ino) -> dict:
        self.store.discard(ino)
        return {}

    async def op_rmdir(self, session, parent, name) -> dict:
        self.store.rmdir(parent, name)
        return {}

    async def op_rename(self, session, parent, name, new_parent, new_name, flags=0) -> dict:
        self.store.rename(parent, name, new_parent, new_name, flags)
        return {}

    async def op_readdir(self, session, ino, offset, limit=1024) -> dict:
        entries = self.store.readdir(ino, offset, max(1, min(limit, 4096)))
        # Full attributes: the kernel uses READDIRPLUS and caches what it is given. `parent`
        # is what the mount lists as `..` (it makes `.` and `..` itself: no reference).
        return {"entries": [[name, self._known(session, node), cookie]
                            for name, node, cookie in entries],
                "parent": self.store.parent_of(ino)}

    async def op_statfs(self, session) -> dict:
        return self.store.statfs()

    async def op_status(self, session) -> dict:
        return self.status()

    async def op_stats(self, session) -> dict:
        return self.stats()

    async def op_ls(self, session, path="/") -> dict:
        store = self.store
        node = store.ns.resolve(path)
        children = (store.readdir(node.ino, 0, 1 << 30) if node.is_dir
                    else [(node.name, node, 0)])
        return {"entries": [
            {"name": name, **child.attrs(), "tier": store.tier_of(child),
             **({"target": child.target} if child.target is not None else {})}
            for name, child, _ in children]}

    async def op_du(self, session, path="/") -> dict:
        return self.store.usage(path)

    async def op_evict(self, session, path=None, all=False) -> dict:  # noqa: A002 (wire name)
        if not all and not path:
            raise FsError(errno.EINVAL, "evict needs a path or all")
        return self.store.evict(None if all else path)

    async def op_import_region(self, session, descriptor, address, length) -> dict:
        """A DOCA export from the host becomes a region of this session (doca engine only:
        the descriptor grants DMA access, so it arrives only on this authenticated channel)."""
        engine = self.regions.engine
        if engine.name != "doca":
            raise DmaError(errno.EOPNOTSUPP, f"this daemon runs the {engine.name} engine: it "
                                             "imports no DOCA exports")
        region = self.regions.add(engine.register(("export", descriptor, address, length),
                                                  owner=session))
        return {"region": region.id, "length": region.length}

    async def op_import_cuda_ipc(self, session, handle, offset, length) -> dict:
        """CUDA device memory named by an IPC handle becomes a region of this session: opened
        here, copied by the GPU (loopback engine; the doca engine takes GPU memory as dma-buf
        exports instead)."""
        engine = self.regions.engine
        if engine.name != "loopback":
            raise DmaError(errno.EOPNOTSUPP, f"the {engine.name} engine does not open CUDA IPC "
                                             "handles: export the memory as a dma-buf fd")
        # Opening may initialise CUDA (a second or more) and blocks: a worker thread.
        region = await trio.to_thread.run_sync(
            engine.register, ("cuda_ipc", handle, offset, length), session)
        if session not in self.sessions.values():   # it ended while the handle was opening
            engine.release(region)
            raise DmaError(errno.ECONNRESET, "the session ended during import_cuda_ipc")
        self.store.tiers.dram.prepare_spares()   # page-locked ahead from now on
        return {"region": self.regions.add(region).id, "length": region.length}

    async def op_release_region(self, session, region) -> dict:
        self.regions.remove(region, owner=session)
        return {}

    async def op_setxattr(self, session, ino, name, value, flags=0) -> dict:
        await self.store.setxattr(ino, name, value, flags)
        return {}

    async def op_getxattr(self, session, ino, name) -> dict:
        return {"value": self.store.getxattr(ino, name)}

    async def op_listxattr(self, session, ino) -> dict:
        # one string as the kernel lists them (NUL after each name): a table of many short
        # names would pass the decoder's bound on list lengths
        return {"names": b"".join(n + b"\0" for n in self.store.listxattr(ino))}

    async def op_removexattr(self, session, ino, name) -> dict:
        await self.store.removexattr(ino, name)
        return {}

    async def op_verify(self, session, start=False) -> dict:
        if start:
            self.verifier.start(self._nursery)
        return self.verifier.progress()
