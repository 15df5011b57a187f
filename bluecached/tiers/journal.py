"""The index on NVMe: an append-only log of msgpack records plus atomic snapshots.

Files in the directory:
    index.snap             header (magic, version, generation S, count, crc) + count framed records
    journal-<gen>.log      framed records appended since the checkpoint that started <gen>
A frame is [u32 length][u32 crc32c(payload)][msgpack payload], little-endian.

State = snapshot S, then every journal with gen >= S in gen order. A checkpoint first switches
appends to journal G+1 and then writes a snapshot claiming G+1 of the state as of the switch, so
a crash at any point leaves either (old snapshot + journals G, G+1) or (new snapshot + journal
G+1, maybe stale older journals that load deletes): never a gap, never a record applied twice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

import crc32c
import msgpack

from ..paths import fsync_directory

log = logging.getLogger("bluecached.tiers.journal")

SNAP_NAME = "index.snap"
SNAP_MAGIC = b"BCIDXSNP"
SNAP_VERSION = 1
_SNAP_HEADER = struct.Struct("<8sIQQ")  # magic, version, generation, record count
_CRC = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # payload length, crc32c of payload
_JOURNAL_RE = re.compile(r"journal-(\d{8,})\.log")
_WRITE_BATCH = 1 << 20
# Space the journal holds ahead of its end (fallocate, size unchanged): appends then need no
# new blocks, so a filesystem filled by others does not refuse the index the record of data
# already written.
PREALLOCATE = 8 << 20
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def _preallocate(fd: int, offset: int, length: int) -> bool:
    """Reserves blocks without changing the file's size; False where that is not possible."""
    return _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0


class JournalError(Exception):
    pass


def _crc(data) -> int:
    return crc32c.crc32c(data, 0)


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), _crc(payload)) + payload


def _journal_name(gen: int) -> str:
    return f"journal-{gen:08d}.log"


def _unpack(payload):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def _parse_frames(data: bytes, pos: int, out: list, limit: int | None = None) -> tuple[int, str]:
    """Appends the records of consecutive frames in data[pos:] to out; returns where it stopped
    and why ("" at the end of data or after `limit` records)."""
    mv = memoryview(data)
    end = len(data)
    count = 0
    while pos < end and count != limit:
        if end - pos < _FRAME.size:
            return pos, "truncated frame header"
        n, crc = _FRAME.unpack_from(data, pos)
        body = pos + _FRAME.size
        if n == 0 or body + n > end:  # 0: zero-filled tail, e.g. after power loss
            return pos, "truncated record" if n else "empty frame"
        payload = mv[body:body + n]
        if _crc(payload) != crc:
            return pos, "crc mismatch"
        try:
            out.append(_unpack(payload))
        except Exception:  # crc-valid but undecodable: a writer bug, treat as corruption
            return pos, "undecodable record"
        pos = body + n
        count += 1
    return pos, ""


class Journal:
    """Not thread-safe, except that checkpoint_finish and sync may run in worker threads
    (sync in several at once) while the owning thread keeps appending."""

    def __init__(self, path: Path, durable: bool = True):
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)   # the index names every file
        self.durable = durable
        self.generation = -1  # of the journal appends go to; set by load()
        self.journal_bytes = 0
        self._fd = -1
        self._retired: list[int] = []  # journals switched away from, fdatasync'd by sync()
        self._sync_lock = threading.Lock()
        self._dir_dirty = False
        self._pending: int | None = None  # generation of a begun, unfinished checkpoint
        self._packer = msgpack.Packer(use_bin_type=True)
        self._reserved_to = 0   # the journal's blocks are reserved up to this offset

    # loading

    def _recovery_hint(self) -> str:
        return (f"To start with an empty cache instead (cached blocks are lost, nothing else), "
                f"stop the daemon and move {self.path} aside; to keep trying, restore "
                f"{SNAP_NAME} from a copy")

    def _journals(self) -> list[int]:
        gens = []
        for name in os.listdir(self.path):
            m = _JOURNAL_RE.fullmatch(name)
            if m:
                gens.append(int(m.group(1)))
        return sorted(gens)

    def _read_snapshot(self, out: list) -> int:
        """Appends the snapshot's records to out; returns its generation (0 if none)."""
        path = self.path / SNAP_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        hsize = _SNAP_HEADER.size + _CRC.size
        if len(data) < hsize or data[:len(SNAP_MAGIC)] != SNAP_MAGIC:
            raise JournalError(f"{path}: not an index snapshot (bad magic); refusing to start "
                               f"rather than lose the index. {self._recovery_hint()}")
        _, version, gen, count = _SNAP_HEADER.unpack_from(data)
        if _CRC.unpack_from(data, _SNAP_HEADER.size)[0] != _crc(data[:_SNAP_HEADER.size]):
            raise JournalError(f"{path}: corrupt header (crc mismatch); refusing to start "
                               f"rather than lose the index. {self._recovery_hint()}")
        if version != SNAP_VERSION:
            raise JournalError(f"{path}: snapshot format version {version} is not supported "
                               f"(this daemon reads version {SNAP_VERSION})")
        first = len(out)
        pos, why = _parse_frames(data, hsize, out, limit=count)
        got = len(out) - first
        if why or got != count or pos != len(data):
            del out[first:]
            why = why or (f"{got} of {count} records" if got != count else "trailing bytes")
            raise JournalError(f"{path}: corrupt snapshot ({why} at offset {pos}); refusing "
                               f"to start rather than lose the index. {self._recovery_hint()}")
        return gen

    def _replay(self, gen: int, out: list) -> None:
        path = self.path / _journal_name(gen)
        data = path.read_bytes()
        pos, why = _parse_frames(data, 0, out)
        if why:
            # a torn append (crash) or corruption: what follows cannot be trusted; cut it off so
            # later appends are not hidden behind it
            log.warning("%s: %s at offset %d; dropping the last %d bytes of the journal",
                        path, why, pos, len(data) - pos)
            os.truncate(path, pos)

    def load(self) -> list:
        """Snapshot records followed by journal records, in order. Call once, before appending."""
        if self.generation >= 0:
            raise JournalError("load() was already called")
        (self.path / (SNAP_NAME + ".tmp")).unlink(missing_ok=True)  # an unfinished checkpoint
        records: list = []
        snap_gen = self._read_snapshot(records)
        live = []
        for gen in self._journals():
            if gen < snap_gen:  # folded into the snapshot
                (self.path / _journal_name(gen)).unlink()
            else:
                live.append(gen)
        for gen in live:
            self._replay(gen, records)
        self.generation = live[-1] if live else snap_gen
        self._open_journal(self.generation)
        return records

    def _open_journal(self, gen: int) -> None:
        path = self.path / _journal_name(gen)
        existed = path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.journal_bytes = os.fstat(self._fd).st_size
        self._reserved_to = 0
        self._reserve()
        if not existed:
            self._dir_dirty = True  # sync() makes the new name durable

    # appending

    def _write(self, buf: bytes) -> None:
        if self._fd < 0:
            raise JournalError("load() must be called before appending")
        mv = memoryview(buf)
        done = 0
        try:
            while done < len(mv):
                done += os.write(self._fd, mv[done:])
        except OSError:
            # leave no partial frame behind: it would hide every later record from replay
            try:
                os.ftruncate(self._fd, self.journal_bytes)
            except OSError:
                pass
            raise
        self.journal_bytes += done
        self._reserve()

    def _reserve(self) -> None:
        if self.journal_bytes + PREALLOCATE // 2 > self._reserved_to and \
                _preallocate(self._fd, self.journal_bytes, PREALLOCATE):
            self._reserved_to = self.journal_bytes + PREALLOCATE

    def append(self, record) -> None:
        self._write(_frame(self._packer.pack(record)))

    def append_many(self, records) -> None:
        pack = self._packer.pack
        buf = b"".join(_frame(pack(r)) for r in records)
        if buf:
            self._write(buf)

    def sync(self) -> None:
        """Makes every record appended before the call durable (a no-op unless durable).
        Runs in worker threads, several at once (write-behind workers), while the owning
        thread appends and begins checkpoints: one sync at a time, and it reads the current
        journal before the retired ones, so a switch in between leaves that journal among
        the retired ones it syncs (once they overlapped, a sync closed a journal another had
        not synced yet and failed on an empty list)."""
        if not self.durable:
            return
        with self._sync_lock:
            current = self._fd
            if self._dir_dirty:
                self._dir_dirty = False   # first: a name made meanwhile keeps it set
                try:
                    fsync_directory(self.path)
                except BaseException:
                    self._dir_dirty = True
                    raise
            retired = list(self._retired)
            # older journals first: a durable record must not follow a lost one
            for fd in retired + ([current] if current >= 0 and current not in retired else []):
                os.fdatasync(fd)
            for fd in retired:   # only syncs close them (and close(), at the end)
                self._retired.remove(fd)
                os.close(fd)

    # checkpoints

    def checkpoint(self, records: Iterable) -> None:
        """Replaces the log with a snapshot of records, which must be the state as of now.
        Nothing is appended meanwhile (shutdown), so the snapshot is written before the
        switch: if it fails (a full disk), appends stay in the current journal, which keeps
        the space it holds in reserve."""
        if self._fd < 0:
            raise JournalError("load() must be called before a checkpoint")
        gen = self.generation + 1
        self._pending = gen
        self._write_snapshot_file(gen, records)   # resets _pending on failure
        old = self._fd
        self._open_journal(gen)
        os.close(old)
        self.generation = gen
        self._finish_switch(gen)

    def checkpoint_begin(self) -> int:
        """Switches appends to a new journal and returns its generation. Fast (one open), so
        the caller can do it and capture the state it will snapshot in one step; records
        appended afterwards go to the new journal and are replayed after the snapshot."""
        if self._fd < 0:
            raise JournalError("load() must be called before a checkpoint")
        if self._pending is not None:
            raise JournalError("a checkpoint is already in progress")
        gen = self.generation + 1
        old = self._fd
        self._open_journal(gen)
        if self.durable:
            self._retired.append(old)
        else:
            os.close(old)
        self.generation = gen
        self._pending = gen
        return gen

    def checkpoint_finish(self, records: Iterable) -> None:
        """Writes the snapshot begun by checkpoint_begin. records must be the state as of that
        call and must not change meanwhile; may run in a worker thread."""
        gen = self._pending
        if gen is None:
            raise JournalError("checkpoint_finish() without checkpoint_begin()")
        self._write_snapshot_file(gen, records)
        self._finish_switch(gen)

    def _write_snapshot_file(self, gen: int, records: Iterable) -> None:
        tmp = self.path / (SNAP_NAME + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                count = self._write_snapshot(fd, gen, records)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path / SNAP_NAME)
        except BaseException:
            tmp.unlink(missing_ok=True)
            self._pending = None
            raise
        log.debug("checkpoint: %d records in snapshot %d", count, gen)

    def _finish_switch(self, gen: int) -> None:
        try:
            if self.durable:
                fsync_directory(self.path)  # the rename, before the journals it replaces go
            for old in self._journals():
                if old < gen:
                    (self.path / _journal_name(old)).unlink(missing_ok=True)
        finally:
            self._pending = None

    @staticmethod
    def _write_snapshot(fd: int, gen: int, records: Iterable) -> int:
        pack = msgpack.Packer(use_bin_type=True).pack  # own packer: may run in a worker thread
        hsize = _SNAP_HEADER.size + _CRC.size
        os.write(fd, bytes(hsize))  # placeholder until the count is known
        count = 0
        buf: list[bytes] = []
        size = 0
        for rec in records:
            frame = _frame(pack(rec))
            buf.append(frame)
            size += len(frame)
            count += 1
            if size >= _WRITE_BATCH:
                _write_all(fd, b"".join(buf))
                buf, size = [], 0
        _write_all(fd, b"".join(buf))
        header = _SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, gen, count)
        os.pwrite(fd, header + _CRC.pack(_crc(header)), 0)
        return count

    def close(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]
