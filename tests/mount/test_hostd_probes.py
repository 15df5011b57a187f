"""hostd's /metrics, /healthz and /readyz on a real mount: requests per FUSE operation, bytes,
latency histograms, errors by errno, ioctls; readiness that follows bluecached."""

import errno
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hostd.zerocopy import SharedBuffer, load_into, store_from
from support import HostdProcess, MiB, force_unmount, free_port, pattern


@pytest.fixture
def engine():
    return "loopback"   # what is counted is hostd's, whichever engine moves the bytes


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _samples(body: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


@pytest.fixture
def mounted(tmp_path, daemon):
    d = daemon().start()
    mnt = tmp_path / "mnt"
    port = free_port()
    # without passthrough every read and write reaches hostd, to be counted
    h = HostdProcess(d, mnt, **{"metrics.listen": f"127.0.0.1:{port}",
                                "mount.passthrough": False}).start()
    try:
        yield d, h, mnt, f"http://127.0.0.1:{port}"
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
        h.stop()
        force_unmount(mnt)


def test_metrics_count_requests_bytes_latency_errors_and_ioctls(mounted):
    d, h, mnt, base = mounted
    data = pattern("m", 3 * MiB)
    (mnt / "a.bin").write_bytes(data)
    (mnt / "d").mkdir()
    (mnt / "d" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as e:                   # hostd answers ENOTEMPTY
        os.rmdir(mnt / "d")
    assert e.value.errno == errno.ENOTEMPTY
    with SharedBuffer(MiB) as buf:
        buf.view()[:] = pattern("z", MiB)
        assert store_from(str(mnt / "z.bin"), buf) == MiB
        assert load_into(str(mnt / "z.bin"), buf) == MiB
    reads_before = _samples(_get(f"{base}/metrics")[1])
    with open(mnt / "a.bin", "rb") as f:
        assert f.read() == data
    status, body = _get(f"{base}/metrics")
    assert status == 200
    s = _samples(body)
    assert s[("bluecache_hostd_fuse_requests_total", (("op", "create"),))] >= 1
    assert s[("bluecache_hostd_fuse_requests_total", (("op", "write"),))] >= 3
    assert s[("bluecache_hostd_written_bytes_total", ())] >= len(data)
    assert s[("bluecache_hostd_fuse_errors_total", (("errno", "ENOTEMPTY"), ("op", "rmdir")))] == 1
    assert s[("bluecache_hostd_ioctls_total", (("command", "store"),))] == 1
    assert s[("bluecache_hostd_ioctls_total", (("command", "load"),))] == 1
    assert s[("bluecache_hostd_zero_copy_bytes_total", ())] == 2 * MiB
    assert s[("bluecache_hostd_daemon_connected", ())] == 1
    # every request counted lands in one bucket of its operation's histogram
    lookups = s[("bluecache_hostd_fuse_requests_total", (("op", "lookup"),))]
    assert s[("bluecache_hostd_fuse_request_seconds_count", (("op", "lookup"),))] == lookups
    assert s[("bluecache_hostd_fuse_request_seconds_bucket",
              (("le", "+Inf"), ("op", "lookup")))] == lookups
    read_bytes = s[("bluecache_hostd_read_bytes_total", ())] - \
        reads_before[("bluecache_hostd_read_bytes_total", ())]
    assert read_bytes == len(data)
    opens = s[("bluecache_hostd_fuse_requests_total", (("op", "open"),))]
    assert opens >= 2


def test_healthz_and_readyz_follow_the_mount_and_bluecached(mounted):
    d, h, mnt, base = mounted
    assert _get(f"{base}/healthz") == (200, "ok\n")
    assert _get(f"{base}/readyz") == (200, "ready\n")
    d.proc.send_signal(signal.SIGSTOP)     # bluecached hung: the mount cannot serve
    try:
        deadline = time.monotonic() + 30
        while (answer := _get(f"{base}/readyz"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = answer
        assert status == 503 and body.startswith("not ready: "), answer
        assert _get(f"{base}/healthz") == (200, "ok\n")   # hostd itself is alive
    finally:
        d.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while _get(f"{base}/readyz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _get(f"{base}/readyz") == (200, "ready\n")
