"""The README's run command, `bluecachectl up`, as a user runs it: a foreground process that
prints `ready` once the mount serves, serves a connector, and on Ctrl-C stops both daemons,
unmounts and keeps the cache for the next start."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import MiB, force_unmount, free_port, is_mounted, pattern

pytestmark = pytest.mark.slow


class Up:
    def __init__(self, tmp_path, *options):
        self.mnt = tmp_path / "mnt"
        self.state = tmp_path / "state"
        self.mnt.mkdir(exist_ok=True)
        self.port = free_port()
        # --state-dir after the command, as the README writes it.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bluecached.ctl", "up", "--mount", str(self.mnt),
             "--state-dir", str(self.state), "--dram-size", "128MiB", "--nvme-size", "256MiB",
             "--metrics", f"127.0.0.1:{self.port}",
             "--hostd-metrics", f"127.0.0.1:{free_port()}", *options],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        with self.proc.stdout:
            for line in self.proc.stdout:
                self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float = 120) -> str:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r} in {timeout}s:\n"
                                     + "".join(self.lines)) from None
            if line is None:
                raise AssertionError(f"`up` exited ({self.proc.wait()}) before {needle!r}:\n"
                                     + "".join(self.lines))
            self.lines.append(line)
            if needle in line:
                return line

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=120)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code

    def children(self) -> dict[str, int]:
        """The daemons `up` started, by module name: {"bluecached": pid, "hostd": pid}."""
        pid = self.proc.pid
        out = {}
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"-m" in argv:
                out[argv[argv.index(b"-m") + 1].decode().split(".")[0]] = int(child)
        return out

    def rest(self, timeout: float = 120) -> str:
        """Everything printed until the last writer of the pipe (up or a child) is gone."""
        deadline = time.monotonic() + timeout
        while (line := self._queue.get(timeout=max(0.1, deadline - time.monotonic()))) \
                is not None:
            self.lines.append(line)
        return "".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        force_unmount(self.mnt)     # also lifts the guard of the bare mountpoint


def _log_problems(lines):
    return [line for line in lines
            if any(word in line for word in ("WARNING", "ERROR", "Traceback", "CRITICAL"))]


def test_up_serves_a_connector_stops_cleanly_and_keeps_the_cache(tmp_path):
    data = pattern("up", 32 * MiB)
    name = block_name(1)
    up = Up(tmp_path)
    try:
        ready = up.wait_for("ready")
        assert str(up.mnt) in ready
        assert is_mounted(up.mnt)
        assert llmd_write(up.mnt, name, data, "a")
        assert llmd_read(up.mnt, name) == data
        stats = subprocess.run(
            [sys.executable, "-m", "bluecached.ctl", "--state-dir", str(up.state), "stats",
             "--json"], capture_output=True, text=True, timeout=30)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["files"] == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/metrics", timeout=10) as r:
            assert b"bluecache" in r.read()
        assert up.stop() == 0, "".join(up.lines)
        assert not is_mounted(up.mnt)
        assert any("stopped" in line for line in up.lines), "".join(up.lines)
        assert not _log_problems(up.lines), "".join(up.lines)
    finally:
        up.kill()

    again = Up(tmp_path)
    try:
        again.wait_for("ready")
        assert llmd_read(again.mnt, name) == data  # persisted across the stop
        assert again.stop() == 0, "".join(again.lines)
        assert not _log_problems(again.lines), "".join(again.lines)
    finally:
        again.kill()


def test_up_refuses_a_bad_size_naming_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bluecached.ctl", "up", "--mount",
                        str(tmp_path / "m"), "--state-dir", str(tmp_path / "s"),
                        "--dram-size", "lots"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "lots" in r.stderr and "dram" in r.stderr


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's reaper may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_sigkill_of_up_stops_both_daemons_cleanly(tmp_path):
    """`up` killed with SIGKILL (no chance to stop its children): the kernel sends bluecached
    and hostd SIGTERM (PR_SET_PDEATHSIG), so they do not run on unsupervised: hostd unmounts,
    bluecached persists the cache, and the next `up` serves it."""
    data = pattern("orphan", 16 * MiB)
    name = block_name(7)
    up = Up(tmp_path)
    children = {}
    try:
        up.wait_for("ready")
        children = up.children()
        assert sorted(children) == ["bluecached", "hostd"], children
        assert llmd_write(up.mnt, name, data, "a")
        up.proc.kill()
        up.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_running(pid) for pid in children.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {n: pid for n, pid in children.items() if _running(pid)}
        assert not left, f"still running after `up` was killed: {left}"
        assert not is_mounted(up.mnt)
        output = up.rest()
        assert "stopped cleanly" in output, output      # bluecached's SIGTERM path
        assert not _log_problems(up.lines), output
    finally:
        for pid in children.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        up.kill()

    again = Up(tmp_path)
    try:
        again.wait_for("ready")
        assert llmd_read(again.mnt, name) == data
        assert again.stop() == 0, "".join(again.lines)
    finally:
        again.kill()
