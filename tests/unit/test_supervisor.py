"""bluecached.supervisor: start, READY=1 with a deadline, stop with a signal then SIGKILL."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bluecached.supervisor import NotReady, Supervised, set_options

ROOT = Path(__file__).resolve().parents[2]

# A stand-in daemon: says READY=1 after `delay` seconds, then runs until signalled.
NOTIFYING = textwrap.dedent("""
    import os, signal, socket, sys, time
    delay, ignore_term = float(sys.argv[1]), sys.argv[2] == "ignore"
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(delay)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(os.environ["NOTIFY_SOCKET"])
        s.send(b"READY=1\\nSTATUS=serving")
    while True:
        time.sleep(1)
""")


def daemon(tmp_path, delay=0.0, ignore_term=False) -> Supervised:
    return Supervised("standin", [sys.executable, "-c", NOTIFYING, str(delay),
                                  "ignore" if ignore_term else "-"], tmp_path / "notify.sock",
                      log=tmp_path / "standin.log")


def test_ready_is_stamped_when_it_came_not_when_it_was_read(tmp_path):
    d = daemon(tmp_path, delay=0.2).start()
    try:
        time.sleep(1.0)     # READY=1 waits in the socket meanwhile
        ready = d.wait_ready(10)
        assert 0.15 < ready - d.started_at < 0.9
        assert d.messages == ["READY=1\nSTATUS=serving"]
    finally:
        assert d.stop() == -signal.SIGTERM
    assert not d.killed
    assert not (tmp_path / "notify.sock").exists()


def test_exit_before_ready_and_a_deadline_are_one_line_each(tmp_path):
    gone = Supervised("quitter", [sys.executable, "-c", "raise SystemExit(3)"],
                      tmp_path / "q.sock").start()
    with pytest.raises(NotReady, match=r"^quitter exited with status 3 before it was ready$"):
        gone.wait_ready(10)
    # its notify socket went with it: a caller that never stops a failed start leaks nothing
    assert not (tmp_path / "q.sock").exists()
    assert gone.stop() == 3
    slow = daemon(tmp_path, delay=30).start()
    try:
        with pytest.raises(NotReady, match=r"^standin was not ready within 0.3s$"):
            slow.wait_ready(0.3)
    finally:
        slow.stop()


def test_stop_kills_what_ignores_sigterm_after_the_timeout(tmp_path):
    d = daemon(tmp_path, ignore_term=True).start()
    d.wait_ready(10)
    t0 = time.monotonic()
    assert d.stop(timeout=0.5) == -signal.SIGKILL
    assert d.killed
    assert time.monotonic() - t0 < 5


def test_a_child_tied_to_its_supervisor_gets_one_sigterm_when_it_is_killed(tmp_path):
    """die_with_parent: the kernel signals the child once per thread of the dying supervisor
    it is handed on to, so the supervisor must run no thread of its own (a second SIGTERM
    kills a daemon that is stopping)."""
    count = tmp_path / "sigterms"
    child = textwrap.dedent(f"""
        import os, signal, socket, time
        def on_term(signum, frame):
            with open({str(count)!r}, "a") as f:
                f.write("x")
        signal.signal(signal.SIGTERM, on_term)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(os.environ["NOTIFY_SOCKET"])
            s.send(b"READY=1")
        time.sleep(3)
    """)
    supervisor = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from bluecached.supervisor import Supervised
        d = Supervised("child", [sys.executable, "-c", {child!r}],
                       Path({str(tmp_path / "c.sock")!r}), die_with_parent=True,
                       new_session=True).start()
        d.wait_ready(30)
        print(d.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", supervisor], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    with proc.stdout:
        try:
            pid = int(proc.stdout.readline())
        finally:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 20
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count.read_text() == "x"


def running(pid: int) -> bool:
    """Exists and is no zombie (its new parent may be slow to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_set_options_flattens_sections_and_quotes_values():
    assert set_options({"tiers.dram.size": 1 << 20, "metrics.listen": "",
                        "remote": {"endpoint": "http://h:1", "sign_payload": False},
                        "tiers.nvme.path": Path("/var/lib/x y")}) == [
        "--set", "tiers.dram.size=1048576", "--set", 'metrics.listen=""',
        "--set", 'remote.endpoint="http://h:1"', "--set", "remote.sign_payload=false",
        "--set", 'tiers.nvme.path="/var/lib/x y"']
