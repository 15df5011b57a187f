"""Prometheus metrics and health probes on a small HTTP endpoint, served from the daemon's trio
loop (no thread of its own).

prometheus_client writes the exposition (`generate_latest`) from a registry of the daemon's
own, never the library's global one, so several daemons in one process (the tests) do not
collide. The values are read when Prometheus scrapes (collectors over the daemon's stats), so
the request paths only bump plain counters. The same endpoint answers the probes an
orchestrator asks: /healthz (the process's event loop answers) and /readyz (it serves; 503
with the reason when it does not). hostd serves its own metrics with this module too.
"""

import logging
from collections.abc import Awaitable, Callable

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("bluecached.metrics")

# The Prometheus text format generate_latest writes (version 0.0.4, in every prometheus_client).
TEXT_FORMAT = b"text/plain; version=0.0.4; charset=utf-8"
PLAIN = b"text/plain; charset=utf-8"

# (metric name, type, help, path into the stats dict)
_TIER_METRICS = [
    ("bytes", "gauge", "Bytes held in the tier"),
    ("capacity_bytes", "gauge", "Configured capacity of the tier"),
    ("objects", "gauge", "Objects held in the tier"),
    ("hits", "counter", "Reads served from the tier"),
    ("misses", "counter", "Reads that did not find the object in the tier"),
    ("evictions", "counter", "Objects evicted from the tier"),
]
_GLOBAL_METRICS = [
    ("files", "gauge", "Files in the namespace"),
    ("dirty_bytes", "gauge", "Bytes in DRAM not yet written behind to NVMe"),
    ("checksum_failures", "counter", "Objects removed because their CRC32C did not match"),
    ("writeback_failures", "counter", "Write-behind attempts that failed"),
    ("tmp_collected", "counter", "Orphaned .tmp files removed"),
    ("requests", "counter", "Control requests served"),
    ("bad_messages", "counter", "Malformed control messages received"),
    ("open_handles", "gauge", "Open file handles"),
    ("regions", "gauge", "Registered DMA regions"),
]
# The remote tier's own state, when it is configured (stats["remote"]).
_REMOTE_METRICS = [
    ("up", "gauge", "1 while the S3 endpoint answers, 0 while it is unreachable"),
    ("queue_length", "gauge", "Uploads waiting"),
    ("uploads", "counter", "Objects uploaded"),
    ("upload_bytes", "counter", "Bytes uploaded"),
    ("upload_seconds", "counter", "Seconds spent in S3 uploads (wall time, summed)"),
    ("uploads_dropped", "counter", "Uploads dropped because the queue was full"),
    ("upload_failures", "counter", "Uploads that failed for good"),
    ("lookups", "counter", "Local misses looked up in the remote tier"),
    ("negative_hits", "counter", "Lookups answered by the negative cache"),
    ("skipped_down", "counter", "Lookups answered as misses while unreachable"),
    ("fetches", "counter", "Objects fetched"),
    ("fetch_bytes", "counter", "Bytes fetched"),
    ("fetch_seconds", "counter", "Seconds spent in S3 downloads and their checks (summed)"),
    ("fetch_failures", "counter", "Fetches that failed (the reader got EIO)"),
    ("prefetches", "counter", "Fetches started by a lookup (also counted as fetches)"),
    ("prefetches_read", "counter", "Prefetched objects a client then read"),
    ("prefetches_dropped", "counter", "Prefetches not done: no DRAM room at once, queue full"),
    ("opening_gets", "counter", "Lookups asked with a GET of the first bytes, as a prefetch"),
    ("listed_hits", "counter", "Directory lookups answered by a recent LIST"),
    ("checksum_failures", "counter", "Remote objects whose CRC32C did not match"),
    ("capacity_deletes", "counter", "Objects deleted to keep within max_bytes / max_age"),
    ("errors", "counter", "Failed S3 requests"),
]


def family(name: str, kind: str, text: str, labels: list[str] | None = None):
    """A metric family of `kind` ("counter": exposed as NAME_total, "gauge") to add samples to."""
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, text + ".", labels=labels or [])


class StatsCollector:
    """bluecached's metrics, read from its stats() dict at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for name, kind, text in _TIER_METRICS:
            metric = family(f"bluecache_tier_{name}", kind, text, ["tier"])
            for tier, values in stats["tiers"].items():
                if name in values:
                    metric.add_metric([tier], values[name])
            yield metric
        for name, kind, text in _GLOBAL_METRICS:
            metric = family(f"bluecache_{name}", kind, text)
            metric.add_metric([], stats[name])
            yield metric
        remote = stats.get("remote")
        for name, kind, text in _REMOTE_METRICS if remote else ():
            metric = family(f"bluecache_remote_{name}", kind, text)
            metric.add_metric([], remote[name])
            yield metric


def registry(*collectors) -> CollectorRegistry:
    """A registry of the daemon's own with `collectors` (objects with a collect())."""
    out = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        out.register(collector)
    return out


# A route answers (HTTP status, content type, body).
Route = Callable[[], Awaitable[tuple[int, bytes, bytes]]]
# A readiness check: None when ready, else why not (one line).
Readiness = Callable[[], Awaitable[str | None]]
_REASONS = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable"}


def routes(collectors: CollectorRegistry, ready: Readiness) -> dict[bytes, Route]:
    """/metrics (and /), /healthz and /readyz."""

    async def metrics():
        return 200, TEXT_FORMAT, generate_latest(collectors)

    async def healthz():   # answered by the event loop: it runs
        return 200, PLAIN, b"ok\n"

    async def readyz():
        problem = await ready()
        if problem is None:
            return 200, PLAIN, b"ready\n"
        return 503, PLAIN, f"not ready: {problem}\n".encode()

    return {b"/metrics": metrics, b"/": metrics, b"/healthz": healthz, b"/readyz": readyz}


async def _serve_one(stream: trio.SocketStream, table: dict[bytes, Route]) -> None:
    try:
        request = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                data = await stream.receive_some(4096)
                if not data:
                    break
                request += data
        line = request.split(b"\r\n", 1)[0].split()
        route = table.get(line[1].split(b"?", 1)[0]) if len(line) >= 2 else None
        if route is not None and line[0] in (b"GET", b"HEAD"):
            status, ctype, body = await route()
        else:
            status, ctype = 404, PLAIN
            body = b"not found: try " + b", ".join(p for p in table if p != b"/") + b"\n"
        head = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (status, _REASONS[status], ctype, len(body)))
        await stream.send_all(head if line[:1] == [b"HEAD"] else head + body)
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()


async def serve(listen: str, table: dict[bytes, Route], *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serves `table` (routes()) on "HOST:PORT" until cancelled; started once listening."""
    host, _, port = listen.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(port), host=host.strip("[]") or None)
    # Names no /readyz: `bluecachectl up` users (and its tests) wait for a line with "ready".
    log.info("metrics on http://%s/metrics", listen)
    task_status.started()
    await trio.serve_listeners(lambda s: _serve_one(s, table), listeners)
