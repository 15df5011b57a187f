"""hostd's request counting (hostd/metrics.py) without a kernel: what an instrumented
Operations counts, and how the exposition reads it."""

import errno
import os

import pyfuse3
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bluecached.metrics import registry
from hostd import ioctl_abi as abi
from hostd.kept_backings import KeptBackings
from hostd.metrics import BUCKETS, FuseCounts, HostdCollector, Latency


class Ops:
    async def read(self, fh, off, size):
        return b"x" * size

    async def write(self, fh, off, buf):
        return len(buf)

    async def unlink(self, parent, name, ctx):
        raise pyfuse3.FUSEError(errno.ENOENT)


class Link:
    bytes_copied = 7
    read_ahead = None
    kept = None

    class staging:   # noqa: N801 - stands for the link's Staging
        @staticmethod
        def free():
            return 5

    class _connected:   # noqa: N801 - stands for the link's trio.Event
        @staticmethod
        def is_set():
            return True


class KeptRegions(list):
    registrations = 3


class Transfers:
    commands = frozenset({abi.IOC_STORE, abi.IOC_LOAD, abi.IOC_QUERY})
    changing = frozenset({abi.IOC_STORE})
    zero_copy_bytes = 0
    regions = KeptRegions([1, 2])

    async def serve(self, cmd, fh, request, pid):
        if cmd == abi.IOC_LOAD:
            raise OSError(errno.ENOENT, "gone")
        return b""


def _samples(counts: FuseCounts, **kw) -> dict:
    text = generate_latest(registry(HostdCollector(counts, Link(), **kw))).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_requests_bytes_errors_and_latency_are_counted():
    counts, ops = FuseCounts(), Ops()
    counts.instrument(ops)
    transfers = counts.transfers(Transfers())

    async def main():
        assert await ops.read(1, 0, 100) == b"x" * 100
        assert await ops.write(1, 0, b"abc") == 3
        with pytest.raises(pyfuse3.FUSEError):
            await ops.unlink(1, b"n", None)
        await transfers.serve(abi.IOC_STORE, 1, b"", 1)
        with pytest.raises(OSError):
            await transfers.serve(abi.IOC_LOAD, 1, b"", 1)

    trio.run(main)
    s = _samples(counts, transfers=Transfers())
    assert s[("bluecache_hostd_fuse_requests_total", (("op", "read"),))] == 1
    assert s[("bluecache_hostd_fuse_requests_total", (("op", "unlink"),))] == 1
    assert s[("bluecache_hostd_read_bytes_total", ())] == 100
    assert s[("bluecache_hostd_written_bytes_total", ())] == 3
    assert s[("bluecache_hostd_fuse_errors_total", (("errno", "ENOENT"), ("op", "unlink")))] == 1
    assert s[("bluecache_hostd_fuse_request_seconds_count", (("op", "read"),))] == 1
    assert ("bluecache_hostd_fuse_request_seconds_count", (("op", "getattr"),)) not in s
    assert s[("bluecache_hostd_ioctls_total", (("command", "store"),))] == 1
    assert s[("bluecache_hostd_ioctl_errors_total", (("command", "load"), ("errno", "ENOENT")))] \
        == 1
    assert s[("bluecache_hostd_copied_bytes_total", ())] == 7
    assert s[("bluecache_hostd_staging_slots_free", ())] == 5
    assert s[("bluecache_hostd_daemon_connected", ())] == 1
    assert s[("bluecache_hostd_zero_copy_regions_kept", ())] == 2
    assert s[("bluecache_hostd_zero_copy_registrations_total", ())] == 3


def test_in_place_writes_count_as_writes_when_answered():
    counts = FuseCounts()

    class Writer:
        staging = object()

        def write_in_slot(self, fh, offset, slot, length, answer):
            self.answer = answer

    inner = Writer()
    writer = counts.slot_writer(inner)
    assert writer.staging is inner.staging
    answers = []
    writer.write_in_slot(1, 0, 3, 4096, answers.append)
    assert counts.requests["write"] == 0          # not answered yet (write_ack: stored)
    inner.answer(None)
    writer.write_in_slot(1, 0, 3, 4096, answers.append)
    inner.answer(OSError(errno.ENOSPC, "full"))
    assert answers[0] is None and answers[1].errno == errno.ENOSPC
    assert counts.requests["write"] == 2 and counts.written_bytes == 4096
    assert counts.errors[("write", "ENOSPC")] == 1


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = Latency()
    for seconds in (BUCKETS[0], BUCKETS[0] * 1.5, 100.0):
        h.observe(seconds)
    buckets = dict(h.cumulative())
    assert buckets["5e-05"] == 1          # le: a value on a bound counts in that bucket
    assert buckets["0.0001"] == 2
    assert buckets["10.0"] == 2 and buckets["+Inf"] == 3
    assert h.total == pytest.approx(BUCKETS[0] * 2.5 + 100)


def test_opens_answered_from_kept_files_are_counted():
    kept = KeptBackings(limit=4, idle=60)
    link = Link()
    link.kept = kept
    fd = os.memfd_create("kept")
    try:
        kept.keep(7, fd, 0, attr=None, generation=1, stamp=kept.stamp())
        os.close(kept.take(7, 1)[0])
        kept.refused_by_daemon(7, kept._kept[7].identity)
    finally:
        os.close(fd)
    text = generate_latest(registry(HostdCollector(FuseCounts(), link))).decode()
    s = {(m.name, tuple(m.labels.items())): m.value
         for f in text_string_to_metric_families(text) for m in f.samples}
    assert s[("bluecache_hostd_opens_kept", ())] == 0
    assert s[("bluecache_hostd_opens_answered_kept_total", ())] == 1
    assert s[("bluecache_hostd_opens_kept_refused_total", ())] == 1
