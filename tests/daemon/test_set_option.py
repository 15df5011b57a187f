"""`--set KEY=VALUE` on both daemons' command lines: applied over the config file with the
file's validation and errors, and applied again by a SIGHUP reload."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bluecached.supervisor import Supervised, python_module
from support import MiB


def run_until_exit(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("module", "assignment", "message"), [
    ("bluecached.daemon", "tiers.dram.size=lots",
     "bluecached: --set: tiers.dram.size: expected a size such as 4GiB or 512MiB, got 'lots'"),
    ("bluecached.daemon", "tiers.dram.sise=1GiB",
     "bluecached: --set: unknown key tiers.dram.sise (known keys here: size, prefault, huge_pages, "
     "high_watermark, low_watermark)"),
    ("bluecached.daemon", "tiers.dram.size",
     "bluecached: --set: expected KEY=VALUE such as tiers.dram.size=1GiB, got 'tiers.dram.size'"),
    ("hostd.daemon", "mount.read_ahead=lots",
     "bluecache-hostd: --set: mount.read_ahead: expected a whole number from 0 to 64, "
     "got 'lots'"),
    ("hostd.daemon", "mount.readahead=8",
     "bluecache-hostd: --set: unknown key mount.readahead (known keys here: allow_other,"),
])
def test_a_bad_set_exits_2_naming_the_key(tmp_path, module, assignment, message):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = run_until_exit(module, "--config", str(empty), "--set", "log_level=debug",
                       "--set", assignment)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(message), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def stats(state_dir: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "bluecached.ctl", "--state-dir", str(state_dir),
                        "stats", "--json"], capture_output=True, text=True, timeout=60,
                       check=True)
    return json.loads(r.stdout)


def wait_for_line(log: Path, text: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()}"
        time.sleep(0.05)
    return next(line for line in log.read_text().splitlines() if text in line)


def test_set_over_the_file_and_again_on_sighup(tmp_path):
    state = tmp_path / "state"
    config = tmp_path / "bluecached.yaml"
    config.write_text(yaml.safe_dump({
        "state_dir": str(state), "metrics": {"listen": ""},
        "tiers": {"dram": {"size": "256MiB", "prefault": 0, "low_watermark": 0.5},
                  "nvme": {"path": str(tmp_path / "nvme"), "size": "256MiB",
                           "segment_size": "64MiB"}}}))
    log = tmp_path / "bluecached.log"
    daemon = Supervised("bluecached", python_module(
        "bluecached.daemon", "--config", str(config), "--set", "tiers.dram.size=64MiB",
        "--set", "tiers.dram.high_watermark=0.6"), tmp_path / "notify.sock", log=log)
    try:
        daemon.start().wait_ready(60)
        assert stats(state)["tiers"]["dram"]["capacity_bytes"] == 64 * MiB
        # A reload reads the file and the --set assignments again: only the file's change
        # shows, the --set watermark stays.
        config.write_text(config.read_text().replace("low_watermark: 0.5", "low_watermark: 0.4"))
        daemon.proc.send_signal(signal.SIGHUP)
        assert wait_for_line(log, "reloaded ").endswith(
            f"reloaded {config}: tiers.dram.low_watermark=0.4")
    finally:
        assert daemon.stop() == 0
    problems = [line for line in log.read_text().splitlines()
                if " WARNING " in line or " ERROR " in line or "Traceback" in line]
    assert not problems, problems
