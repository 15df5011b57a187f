"""What an operator meets first: --version on every command, a fast "not running" from
bluecachectl, and bluecached's /metrics, /healthz and /readyz."""

import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from importlib import metadata

import pytest

from support import free_port


@pytest.mark.parametrize("module,name", [
    ("bluecached.daemon", "bluecached"), ("hostd.daemon", "bluecache-hostd"),
    ("bluecached.ctl", "bluecachectl")])
def test_every_command_says_its_version_from_the_package_metadata(module, name):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{name} {metadata.version('bluecache')}\n"


def _ctl(*args, timeout=20) -> subprocess.CompletedProcess:
    # --timeout 60 against a subprocess timeout of 20 s: waiting for a reply cannot pass
    return subprocess.run([sys.executable, "-m", "bluecached.ctl", "--timeout", "60", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [["status"], ["stats"], ["ls", "/"], ["du"],
                                     ["evict", "--all"], ["verify"]])
def test_every_command_says_at_once_that_bluecached_is_not_running(tmp_path, command):
    # a control socket left by a daemon that died: zmq would wait for one to come
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "control.sock"))
    sock.close()
    r = _ctl("--state-dir", str(tmp_path), *command)
    assert r.returncode == 1
    assert r.stderr == (f"bluecachectl {command[0]}: bluecached is not running at "
                        f"ipc://{tmp_path}/control.sock (connection refused)\n")


def test_not_running_without_a_socket_and_at_a_tcp_endpoint(tmp_path):
    r = _ctl("--state-dir", str(tmp_path / "none"), "status")
    assert r.returncode == 1
    assert "bluecached is not running at ipc://" in r.stderr and "no control.sock" in r.stderr
    from bluecached.wire import curve
    curve.generate(tmp_path, "server")
    curve.generate(tmp_path, "client")
    port = free_port()    # nobody listens there
    r = _ctl("--endpoint", f"tcp://127.0.0.1:{port}", "--curve-dir", str(tmp_path), "stats")
    assert r.returncode == 1
    assert r.stderr == (f"bluecachectl stats: bluecached is not running at "
                        f"tcp://127.0.0.1:{port} (connection refused)\n")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_healthz_and_readyz_follow_the_daemon(daemon):
    port = free_port()
    d = daemon(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/healthz") == (200, "ok\n")
    assert _get(f"{base}/readyz") == (200, "ready\n")
    status, body = _get(f"{base}/metrics")
    assert status == 200 and "bluecache_requests_total" in body
    assert _get(f"{base}/nothing")[0] == 404
    d.proc.send_signal(signal.SIGSTOP)   # a hung daemon answers no probe
    try:
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(f"{base}/healthz", timeout=1)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert _get(f"{base}/healthz") == (200, "ok\n")
    assert d.stop() == 0
