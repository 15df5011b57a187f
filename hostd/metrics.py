"""hostd's metrics and probes: FUSE requests per operation, bytes read and written, latency
histograms, errors by errno, zero-copy ioctls; /readyz asks whether the mount serves.

The request paths only bump plain ints and lists on the event loop's thread (no lock, no
thread, no prometheus_client object per request); the exposition reads them when Prometheus
scrapes (HostdCollector). Served by bluecached/metrics.py's endpoint, with hostd's own
registry, at hostd.yaml's metrics.listen (127.0.0.1:9465 by default).
"""

import bisect
import errno
import inspect
import os
import time
from pathlib import Path

import pyfuse3
import trio
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from bluecached.metrics import family
from fusefs.errors import errno_for

from . import ioctl_abi as abi

# Seconds. A hit from DRAM answers in tens of microseconds; a miss that fetches from NVMe or the
# remote tier, or a request that waits out a bluecached restart, takes up to seconds.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
           0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BUCKET_NAMES = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]

# pyfuse3's request handlers that are counted (those an Operations has).
FUSE_OPS = ("lookup", "forget", "getattr", "setattr", "statfs", "mkdir", "rmdir", "unlink",
            "rename", "opendir", "readdir", "releasedir", "fsyncdir", "create", "mknod",
            "symlink", "readlink", "link", "open", "read", "write", "flush", "fsync",
            "release", "access", "setxattr", "getxattr", "listxattr", "removexattr")
IOCTLS = {abi.IOC_STORE: "store", abi.IOC_LOAD: "load", abi.IOC_QUERY: "query"}

# How long /readyz waits for a statfs of the mountpoint (answered by hostd, which asks
# bluecached) before it says not ready.
PROBE_TIMEOUT = 2.0

# trio 0.23 renamed to_thread.run_sync's `cancellable` (Debian 12 has trio 0.22).
_ABANDON = ("abandon_on_cancel" if "abandon_on_cancel" in
            inspect.signature(trio.to_thread.run_sync).parameters else "cancellable")


def _errno_name(number: int) -> str:
    return errno.errorcode.get(number, str(number))


class Latency:
    """A histogram's buckets (not cumulative) and sum."""

    __slots__ = ("counts", "total")

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for name, count in zip(_BUCKET_NAMES, self.counts, strict=True):
            running += count
            out.append((name, running))
        return out


class FuseCounts:
    """What the mount's requests did, per operation."""

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.latency: dict[str, Latency] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.read_bytes = 0
        self.written_bytes = 0
        self.ioctls = dict.fromkeys(IOCTLS.values(), 0)
        self.ioctl_errors: dict[tuple[str, str], int] = {}

    def done(self, op: str, started: float, err: int | None) -> None:
        self.requests[op] += 1
        self.latency[op].observe(time.perf_counter() - started)
        if err is not None:
            key = (op, _errno_name(err))
            self.errors[key] = self.errors.get(key, 0) + 1

    def _counted(self, op: str, handler):
        self.requests[op] = 0
        self.latency[op] = Latency()
        clock = time.perf_counter

        async def counted(*args):
            started = clock()
            try:
                result = await handler(*args)
            except pyfuse3.FUSEError as e:
                self.done(op, started, e.errno)
                raise
            self.done(op, started, None)
            if op == "read":
                self.read_bytes += len(result)
            elif op == "write":
                self.written_bytes += result
            return result

        return counted

    def instrument(self, ops) -> None:
        """Counts every request pyfuse3 hands `ops` (an fusefs Operations): its handlers are
        looked up on the instance per request, so wrapped ones are what the kernel reaches."""
        for op in FUSE_OPS:
            handler = getattr(ops, op, None)
            if handler is not None:
                setattr(ops, op, self._counted(op, handler))

    def slot_writer(self, writer):
        """`writer` (fusefs' SlotWriter: the link) with its in-place writes counted as
        `write` requests: those reach hostd from the fuse shim, not through pyfuse3."""
        return _CountedSlotWriter(writer, self)

    def transfers(self, transfers):
        """fusefs' Transfers with each zero-copy ioctl counted."""
        return _CountedTransfers(transfers, self)


class _CountedSlotWriter:
    def __init__(self, writer, counts: FuseCounts):
        self.writer, self.counts = writer, counts
        self.staging = writer.staging
        counts.requests.setdefault("write", 0)
        counts.latency.setdefault("write", Latency())

    def write_in_slot(self, fh, offset, slot, length, answer) -> None:
        started, counts = time.perf_counter(), self.counts

        def answered(error):
            counts.done("write", started, None if error is None else errno_for(error))
            if error is None:
                counts.written_bytes += length
            answer(error)

        self.writer.write_in_slot(fh, offset, slot, length, answered)


class _CountedTransfers:
    def __init__(self, transfers, counts: FuseCounts):
        self.inner, self.counts = transfers, counts
        self.commands, self.changing = transfers.commands, transfers.changing

    async def serve(self, cmd: int, fh: int, request: bytes, pid: int) -> bytes:
        name = IOCTLS.get(cmd, hex(cmd))
        self.counts.ioctls[name] = self.counts.ioctls.get(name, 0) + 1
        try:
            return await self.inner.serve(cmd, fh, request, pid)
        except OSError as e:
            key = (name, _errno_name(errno_for(e)))
            self.counts.ioctl_errors[key] = self.counts.ioctl_errors.get(key, 0) + 1
            raise


def _connected(link) -> bool:
    event = getattr(link, "_connected", None)
    return bool(event is not None and event.is_set())


class HostdCollector:
    """hostd's metrics, read from its counts and its link at each scrape."""

    def __init__(self, counts: FuseCounts, link, transfers=None, in_place=None):
        self.counts, self.link = counts, link
        self.transfers = transfers     # ZeroCopyTransfers, once the ioctl serves
        self.in_place = in_place       # InPlaceWrites, once writes are received in place

    def collect(self):
        c = self.counts
        requests = family("bluecache_hostd_fuse_requests", "counter",
                          "FUSE requests answered by hostd, per operation", ["op"])
        for op, n in c.requests.items():
            requests.add_metric([op], n)
        yield requests
        errors = family("bluecache_hostd_fuse_errors", "counter",
                        "FUSE requests answered with an error, per operation and errno",
                        ["op", "errno"])
        for (op, name), n in sorted(c.errors.items()):
            errors.add_metric([op, name], n)
        yield errors
        latency = HistogramMetricFamily(
            "bluecache_hostd_fuse_request_seconds",
            "Time from a FUSE request reaching hostd to its answer, per operation.",
            labels=["op"])
        for op, hist in c.latency.items():
            if c.requests[op]:
                latency.add_metric([op], hist.cumulative(), hist.total)
        yield latency
        for name, value, text in (
                ("read_bytes", c.read_bytes, "Bytes answered to FUSE reads (passthrough reads "
                                             "never reach hostd and are not counted)"),
                ("written_bytes", c.written_bytes, "Bytes of FUSE writes stored"),
                ("copied_bytes", self.link.bytes_copied,
                 "Payload bytes hostd itself copied (POSIX path)")):
            metric = family(f"bluecache_hostd_{name}", "counter", text)
            metric.add_metric([], value)
            yield metric
        ioctls = family("bluecache_hostd_ioctls", "counter",
                        "Zero-copy ioctls served, per command", ["command"])
        for name, n in c.ioctls.items():
            ioctls.add_metric([name], n)
        yield ioctls
        ioctl_errors = family("bluecache_hostd_ioctl_errors", "counter",
                              "Zero-copy ioctls that failed, per command and errno",
                              ["command", "errno"])
        for (name, err), n in sorted(c.ioctl_errors.items()):
            ioctl_errors.add_metric([name, err], n)
        yield ioctl_errors
        if self.transfers is not None:
            metric = family("bluecache_hostd_zero_copy_bytes", "counter",
                            "Bytes moved by zero-copy ioctls")
            metric.add_metric([], self.transfers.zero_copy_bytes)
            yield metric
            metric = family("bluecache_hostd_zero_copy_regions_kept", "gauge",
                            "Client buffers kept registered with bluecached between requests")
            metric.add_metric([], len(self.transfers.regions))
            yield metric
            metric = family("bluecache_hostd_zero_copy_registrations", "counter",
                            "Client buffers registered with bluecached (a kept one is not "
                            "registered again)")
            metric.add_metric([], self.transfers.regions.registrations)
            yield metric
        kept = self.link.kept
        if kept is not None:
            for name, kind, value, text in (
                    ("opens_kept", "gauge", len(kept),
                     "Files whose DRAM memory hostd keeps for opens it answers alone"),
                    ("opens_answered_kept", "counter", kept.answered,
                     "Read-only opens answered by hostd alone from a kept file"),
                    ("opens_kept_refused", "counter", kept.refused,
                     "Kept files bluecached said were no longer the file's bytes"),
                    ("opens_answered_prepared", "counter", kept.answered_prepared,
                     "Read-only opens answered by hostd alone because their lookup said "
                     "they lend nothing (files only on NVMe, read through bluecached)")):
                metric = family(f"bluecache_hostd_{name}", kind, text)
                metric.add_metric([], value)
                yield metric
        if self.in_place is not None:
            metric = family("bluecache_hostd_writes_received", "counter",
                            "FUSE write requests by how hostd received their bytes", ["how"])
            for how, n in self.in_place.counts().items():
                metric.add_metric([how], n)
            yield metric
        ahead = getattr(self.link, "read_ahead", None)
        if ahead is not None:
            for name, value, text in (("read_ahead_served", ahead.served,
                                       "Reads answered from read-ahead"),
                                      ("read_ahead_wasted", ahead.wasted,
                                       "Read-aheads thrown away unread")):
                metric = family(f"bluecache_hostd_{name}", "counter", text)
                metric.add_metric([], value)
                yield metric
        for name, value, text in (
                ("daemon_connected", int(_connected(self.link)),
                 "1 while the link to bluecached is up"),
                ("staging_slots_free", self.link.staging.free(), "Staging slots free now")):
            metric = family(f"bluecache_hostd_{name}", "gauge", text)
            metric.add_metric([], value)
            yield metric


def _mount_device(mountpoint: Path, fstype: str) -> int | None:
    """The device number of the newest mount at `mountpoint` if it is of `fstype`."""
    found = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and fields[4] == str(mountpoint) and tail:
            major, _, minor = fields[2].partition(":")
            found = os.makedev(int(major), int(minor)) if tail[0] == fstype else None
    return found


class Readiness:
    """/readyz of hostd: the mount serves. Ready when hostd said READY=1 and is not stopping,
    its link to bluecached is up, and a statfs of the mountpoint (which the kernel always
    sends to hostd, and hostd to bluecached) returns within PROBE_TIMEOUT from a mount of
    ours (the device of the fuse.bluecache mount listed there)."""

    def __init__(self, mountpoint: Path, link, fstype: str, timeout: float = PROBE_TIMEOUT):
        self.mountpoint, self.link, self.fstype, self.timeout = mountpoint, link, fstype, timeout
        self.state = "starting"     # "serving" from READY=1, "stopping" from the stop
        self._pending = False       # a probe's thread that has not returned yet

    async def __call__(self) -> str | None:
        if self.state != "serving":
            return self.state
        if not _connected(self.link):
            return "no link to bluecached (not running, or restarting)"
        if self._pending:   # one stuck probe is enough: no pile of threads
            return f"the last statfs of {self.mountpoint} has not returned"
        self._pending = True
        with trio.move_on_after(self.timeout):
            return await trio.to_thread.run_sync(self._probe, **{_ABANDON: True})
        return f"{self.mountpoint} did not answer a statfs within {self.timeout:g}s"

    def _probe(self) -> str | None:
        """In a worker thread: the loop must stay free to answer the requests it makes."""
        try:
            os.statvfs(self.mountpoint)
            dev = os.stat(self.mountpoint).st_dev
            # a mountpoint given as a symlink is listed at its target
            ours = _mount_device(Path(os.path.realpath(self.mountpoint)), self.fstype)
        except OSError as e:
            return f"{self.mountpoint}: {e.strerror}"
        finally:
            self._pending = False
        if ours is None or dev != ours:
            return f"{self.mountpoint} is not this hostd's mount"
        return None
