"""Prometheus text exposition of the daemon's stats on a small HTTP endpoint.

The format is a few lines of text; a tiny trio handler serves it without another thread or a
global registry (prometheus_client's server runs in a thread of its own).
"""

import logging

import trio

log = logging.getLogger("bluecached.metrics")

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


def render(stats: dict) -> str:
    lines = []
    for name, kind, text in _TIER_METRICS:
        metric = f"bluecache_tier_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {metric} {text}.", f"# TYPE {metric} {kind}"]
        for tier, values in stats["tiers"].items():
            if name in values:
                lines.append(f'{metric}{{tier="{tier}"}} {values[name]}')
    for name, kind, text in _GLOBAL_METRICS:
        metric = f"bluecache_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {metric} {text}.", f"# TYPE {metric} {kind}", f"{metric} {stats[name]}"]
    remote = stats.get("remote")
    for name, kind, text in _REMOTE_METRICS if remote else ():
        metric = f"bluecache_remote_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {metric} {text}.", f"# TYPE {metric} {kind}", f"{metric} {remote[name]}"]
    return "\n".join(lines) + "\n"


async def _serve_one(stream: trio.SocketStream, stats) -> None:
    try:
        request = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                data = await stream.receive_some(4096)
                if not data:
                    break
                request += data
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1] in (b"/metrics", b"/"):
            body, status = render(stats()).encode(), b"200 OK"
            ctype = b"text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype +
                              b"\r\nContent-Length: " + str(len(body)).encode() +
                              b"\r\nConnection: close\r\n\r\n" + body)
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()


async def serve(listen: str, stats, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    host, _, port = listen.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(port), host=host.strip("[]") or None)
    log.info("metrics on http://%s/metrics", listen)
    task_status.started()
    await trio.serve_listeners(lambda s: _serve_one(s, stats), listeners)
