"""`bluecachectl up` with the daemons' config files (--config, --hostd-config: the same YAML
the units read) and --set DAEMON.KEY=VALUE over them; its daemons' probes and metrics."""

import json
import queue
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
import yaml

from support import MiB, force_unmount, free_port, is_mounted

pytestmark = pytest.mark.slow


def _up(*options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bluecached.ctl", "up", *options],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _lines_until(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    lines: queue.Queue = queue.Queue()

    def pump():
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)

    proc.pump = threading.Thread(target=pump, daemon=True)
    proc.pump.start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {needle!r} in {timeout}s:\n" + "".join(seen)) from None
        if line is None:
            raise AssertionError(f"`up` exited ({proc.wait()}) before {needle!r}:\n"
                                 + "".join(seen))
        seen.append(line)
        if needle in line:
            return seen


def test_up_reads_both_config_files_and_set_options_over_them(tmp_path):
    mnt, state = tmp_path / "from-hostd-yaml", tmp_path / "from-bluecached-yaml"
    ports = {"bluecached": free_port(), "hostd": free_port()}
    bluecached_yaml = tmp_path / "bluecached.yaml"
    bluecached_yaml.write_text(yaml.safe_dump({
        "state_dir": str(state), "tiers": {"dram": {"size": "96MiB"}, "nvme": {"size": 0}},
        "metrics": {"listen": f"127.0.0.1:{ports['bluecached']}"}}))
    hostd_yaml = tmp_path / "hostd.yaml"
    hostd_yaml.write_text(yaml.safe_dump({
        "mountpoint": str(mnt), "metrics": {"listen": f"127.0.0.1:{ports['hostd']}"}}))
    proc = _up("--config", str(bluecached_yaml), "--hostd-config", str(hostd_yaml),
               "--set", "bluecached.tiers.dram.size=80MiB", "--set", "hostd.log_level=debug")
    try:
        lines = _lines_until(proc, "bluecache ready")
        text = "".join(lines)
        assert f"bluecache config: bluecached {bluecached_yaml}, hostd {hostd_yaml}" in text
        assert str(mnt) in lines[-1]           # the mountpoint of hostd.yaml
        assert is_mounted(mnt)
        stats = subprocess.run([sys.executable, "-m", "bluecached.ctl", "--state-dir",
                                str(state), "stats", "--json"], capture_output=True, text=True,
                               timeout=30)
        assert stats.returncode == 0, stats.stderr    # the state_dir of bluecached.yaml
        tiers = json.loads(stats.stdout)["tiers"]
        assert tiers["dram"]["capacity_bytes"] == 80 * MiB   # --set over the file
        assert "nvme" not in tiers                            # the file's nvme.size: 0
        for port in ports.values():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
                assert r.read() == b"ready\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['hostd']}/metrics",
                                    timeout=10) as r:
            assert b"bluecache_hostd_fuse_requests_total" in r.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert not is_mounted(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.pump.join(30)
        force_unmount(mnt)


@pytest.mark.parametrize("option,message", [
    ("bluecached.tiers.dram.sise=1GiB",
     "bluecachectl up: --set: bluecached: unknown key tiers.dram.sise (known keys here: "),
    ("hostd.mount.readahead=8",
     "bluecachectl up: --set: hostd: unknown key mount.readahead (known keys here: "),
    ("hostd.mount.read_ahead=lots",
     "bluecachectl up: --set hostd.mount.read_ahead: expected a whole number"),
    ("tiers.dram.size=1GiB",
     "bluecachectl up: --set tiers.dram.size=1GiB: expected bluecached.KEY=VALUE or "
     "hostd.KEY=VALUE"),
])
def test_up_refuses_a_set_option_naming_the_key(tmp_path, option, message):
    r = subprocess.run([sys.executable, "-m", "bluecached.ctl", "up", "--mount",
                        str(tmp_path / "m"), "--state-dir", str(tmp_path / "s"), "--config", "",
                        "--hostd-config", "", "--set", option], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.startswith(message), r.stderr
    assert not (tmp_path / "s").exists()     # nothing was started


def test_up_refuses_one_port_for_both_daemons_and_a_missing_config(tmp_path):
    base = [sys.executable, "-m", "bluecached.ctl", "up", "--mount", str(tmp_path / "m"),
            "--state-dir", str(tmp_path / "s")]
    r = subprocess.run(base + ["--metrics", "127.0.0.1:9999", "--hostd-metrics",
                               "127.0.0.1:9999"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "both serve metrics at 127.0.0.1:9999" in r.stderr
    r = subprocess.run(base + ["--hostd-config", str(tmp_path / "none.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == f"bluecachectl up: hostd's config {tmp_path}/none.yaml: no such file\n"
