"""bluecached as a process: startup, sd_notify, CLI, metrics, config errors, restart."""

import json
import signal
import subprocess
import sys
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bluecached.wire import protocol
from support import FileClient, MiB, free_port, pattern


def ctl(d, *args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bluecached.ctl", "--state-dir",
                           str(d.state_dir), *args], capture_output=True, text=True,
                          timeout=60, check=check)


def test_ready_status_and_stats(daemon):
    d = daemon().start()
    assert any(m.startswith("READY=1") for m in d.notify_messages)
    assert any("STATUS=" in m for m in d.notify_messages)
    fc = FileClient(d)
    fc.put("/m/a.bin", pattern("a", 3 * MiB))
    assert fc.get("/m/a.bin") == pattern("a", 3 * MiB)
    fc.close()
    stats = json.loads(ctl(d, "stats", "--json").stdout)
    assert stats["files"] == 1
    assert stats["tiers"]["dram"]["bytes"] == 3 * MiB
    assert stats["tiers"]["dram"]["hits"] >= 1
    assert "engine" in ctl(d, "status").stdout
    assert "a.bin" in ctl(d, "ls", "/m").stdout
    assert json.loads(ctl(d, "du", "--json").stdout)["bytes"] == 3 * MiB
    assert d.stop() == 0
    assert any("STOPPING=1" in m for m in d.notify_messages)


def test_control_socket_is_private(daemon):
    d = daemon().start()
    for name in ("control.sock", "events.sock", "dma.sock"):
        assert (d.state_dir / name).stat().st_mode & 0o777 == 0o600


def test_the_index_is_private(daemon):
    # the index names every cached file: directories the daemon creates are 0700, its files 0600
    d = daemon().start()
    client = FileClient(d)
    try:
        client.put("/secret-name.bin", pattern("s", MiB))
    finally:
        client.close()
    d.stop()
    nvme = d.root / "nvme"
    for path in [d.state_dir, nvme, *nvme.iterdir()]:
        if path.suffix == ".sock" or path.is_socket():
            continue
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"


def test_metrics_endpoint(daemon):
    port = free_port()
    daemon(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert '# TYPE bluecache_tier_bytes gauge' in body
    samples = {(s.name, tuple(s.labels.items())): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    assert samples[("bluecache_tier_capacity_bytes", (("tier", "dram"),))] == 268435456
    assert samples[("bluecache_checksum_failures_total", ())] == 0


@pytest.mark.parametrize("text,needle", [
    ("tiers:\n  dram:\n    sise: 1GiB\n", "tiers.dram.sise"),
    ("tiers:\n  dram:\n    size: lots\n", "tiers.dram.size"),
    ("write_policy: sometimes\n", "write_policy"),
])
def test_bad_config_exits_naming_key_and_file(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "bluecached.daemon", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr and str(path) in r.stderr
    assert "Traceback" not in r.stderr


def test_sigterm_persists_everything(daemon):
    d = daemon().start()
    fc = FileClient(d)
    blobs = {f"/r/{i}.bin": pattern(f"t{i}", (i + 1) * MiB + i) for i in range(6)}
    for path, data in blobs.items():
        fc.put(path, data, tmp_suffix="_x.tmp")
    fc.close()
    assert d.stop() == 0
    d.start()
    fc = FileClient(d)
    for path, data in blobs.items():
        assert fc.get(path) == data
    fc.close()
    assert "index rebuilt: 6 files" in d.log_text()


def test_sighup_reloads_watermarks(daemon):
    d = daemon().start()
    d.config.write_text(d.config.read_text().replace(
        "dram:\n", "dram:\n    high_watermark: 0.6\n    low_watermark: 0.5\n"))
    d.proc.send_signal(signal.SIGHUP)
    client = d.client()
    client.call("ping")  # the signal is handled before or after: wait for the log line
    for _ in range(100):
        if "tiers.dram.high_watermark=0.6" in d.log_text():
            break
        import time
        time.sleep(0.05)
    assert "tiers.dram.high_watermark=0.6" in d.log_text()
    client.close()


def test_events_announce_removals(daemon):
    d = daemon().start()
    fc = FileClient(d)
    fc.put("/e/gone.bin", b"x" * 5000)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, protocol.EVENT_REMOVED)
    sub.connect(d.endpoints["events"])
    # a slow joiner misses early events: publish until the subscription is live
    got = None
    for _ in range(50):
        fc.put("/e/probe.bin", b"p")
        ctl(d, "evict", "/e/probe.bin")
        if sub.poll(100):
            got = protocol.decode_event(sub.recv_multipart())
            break
    assert got is not None
    while sub.poll(200):
        sub.recv_multipart()
    assert "removed 1 files" in ctl(d, "evict", "/e/gone.bin").stdout
    assert sub.poll(5000)
    topic, fields = protocol.decode_event(sub.recv_multipart())
    assert topic == b"removed" and fields["name"] == b"gone.bin"
    assert fields["reason"] == "evicted by operator"
    sub.close()
    fc.close()


def test_ctl_reports_a_daemon_that_is_not_there(tmp_path):
    # at once (no socket to connect to), not after the reply timeout
    r = subprocess.run([sys.executable, "-m", "bluecached.ctl", "--state-dir", str(tmp_path),
                        "--timeout", "600", "status"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "bluecached is not running" in r.stderr and "Traceback" not in r.stderr


def test_ctl_as_another_user_says_permission_denied(daemon):
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-c", "import bluecached.ctl"], capture_output=True)
    if probe.returncode:   # a checkout in a 0700 directory (mktemp -d): nobody cannot import it
        pytest.skip("user nobody cannot import the project from this checkout")
    d = daemon().start()
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-m", "bluecached.ctl", "--state-dir", str(d.state_dir),
                        "status"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "permission denied" in r.stderr and "is it running" not in r.stderr, r.stderr


def test_missing_curve_key_hint_is_a_command_that_works(tmp_path):
    from bluecached.wire import curve
    with pytest.raises(curve.CurveError) as e:
        curve.client_keys(tmp_path, "host1")
    hint = str(e.value).split("`")[1]
    assert hint.startswith("bluecachectl keygen")
    r = subprocess.run([sys.executable, "-m", "bluecached.ctl", *hint.split()[1:]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "server.key").exists()


def test_verify_detects_corruption_on_nvme(daemon):
    d = daemon(allow_log=["checksum mismatch"]).start()
    fc = FileClient(d)
    fc.put("/v/good.bin", pattern("g", 2 * MiB))
    fc.put("/v/bad.bin", pattern("b", 2 * MiB))
    fc.close()
    assert d.stop() == 0          # everything on NVMe, index checkpointed
    # Corrupt bad.bin's bytes on disk: find them by content.
    needle = pattern("b", 2 * MiB)[MiB:MiB + 64]
    for seg in sorted((d.root / "nvme").glob("seg-*")):
        raw = seg.read_bytes()
        at = raw.find(needle)
        if at >= 0:
            with open(seg, "r+b") as f:
                f.seek(at)
                f.write(bytes(64))
            break
    else:
        pytest.fail("object bytes not found on NVMe")
    d.start()
    r = ctl(d, "verify", check=False)
    assert r.returncode == 1
    assert "2 objects" in r.stdout and "1 failed" in r.stdout
    listing = ctl(d, "ls", "/v").stdout
    assert "good.bin" in listing and "bad.bin" not in listing


def test_watchdog_pings_and_an_unread_notify_socket_never_stalls_the_daemon(daemon):
    d = daemon().start(env={"WATCHDOG_USEC": "100000"})    # WATCHDOG=1 every 50 ms
    import time
    time.sleep(2)               # nobody reads the notify socket: its queue fills up
    client = d.client(timeout=5)
    assert client.call("ping") == {}
    client.close()
    assert any("WATCHDOG=1" in m for m in d.drain_notify())


@pytest.mark.parametrize("doca, message", [
    # This machine has no DOCA SDK: the default library cannot load.
    ("{}", "engine doca: cannot load DOCA from libdoca_dma.so.2"),
    ("{library: simulator, pci_address: '0000:42:00.0'}",
     "no DOCA device at PCI address 0000:42:00.0 (found: 0000:03:00.0, 0000:b1:00.0)"),
])
def test_a_doca_engine_that_cannot_start_is_a_clear_startup_error(tmp_path, doca, message):
    path = tmp_path / "doca.yaml"
    path.write_text(f"engine: doca\ndoca: {doca}\nstate_dir: {tmp_path / 'state'}\n")
    r = subprocess.run([sys.executable, "-m", "bluecached.daemon", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["ls", "du", "evict"])
def test_ctl_names_the_path_it_did_not_find(daemon, command):
    d = daemon().start()
    r = ctl(d, command, "/no/such.bin", check=False)
    assert r.returncode == 1
    assert r.stderr.strip() == f"bluecachectl {command}: /no/such.bin: No such file or directory"
