"""Bounded I/O time: a stopped (SIGSTOP) or dead daemon must not hang a caller of the mount.

bluecached stopped: every request that needs it fails with EIO once hostd's
`daemon.request_timeout` has passed (1 s here), and the mount serves again, without a remount,
when it comes back (SIGCONT or a restart). hostd stopped: the kernel's own FUSE request timeout
(`mount.kernel_request_timeout`, negotiated in the INIT reply) aborts the connection, so the
blocked caller gets an error instead of waiting for ever.

The assertions are on errnos, never on elapsed time: each syscall runs in a thread joined with a
generous limit only so that a broken build fails instead of hanging.
"""

import errno
import os
import signal
import subprocess
import threading
import time

import pytest

from connectors import llmd_read, llmd_write
from support import HostdProcess, MiB, is_mounted, pattern, wait_serving, wait_settled

JOIN_S = 60
DAEMON_STOPPED = ["lost bluecached", "-> EIO", "not delivered", "failed after it was answered"]


def outcome(fn, *args):
    """Runs fn(*args) in a thread: its result, or the errno it failed with. A call still
    blocked after JOIN_S seconds fails the test (the thread is left to the mount's cleanup)."""
    box = {}

    def body():
        try:
            box["value"] = fn(*args)
        except OSError as e:
            box["errno"] = e.errno

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)}{args} still blocked after {JOIN_S} s"
    return box.get("errno", box.get("value"))


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, MiB, 0)


def _write_and_close(path: str) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"x" * 4096)   # answered once staged (write_ack: staged)...
    finally:
        os.close(fd)                # ... the daemon's failure comes at close
    return 0


def _create(path: str) -> int:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def test_stopped_bluecached_fails_requests_with_eio_then_serves_again(mounted):
    s = mounted(allow_log=DAEMON_STOPPED + ["index: "],
                hostd_settings={"daemon.request_timeout": "1s", "mount.passthrough": False})
    root = str(s.mnt)
    old = pattern("old", 3 * MiB)
    llmd_write(root, "a/old.bin", old, "w")
    llmd_write(root, "a/scratch.bin", b"s", "w")
    wait_settled(s.daemon)      # on NVMe: survives the SIGKILL below
    reader = os.open(os.path.join(root, "a/old.bin"), os.O_RDONLY)
    pid = s.daemon.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        # a READ of an open file, an OPEN of a file the kernel knows, a LOOKUP of a name it
        # does not, a CREATE, a write whose failure close reports, a listing
        assert outcome(_read_fd, reader) == errno.EIO
        assert outcome(os.open, os.path.join(root, "a/old.bin"), os.O_RDONLY) == errno.EIO
        assert outcome(os.stat, os.path.join(root, "a/never.bin")) == errno.EIO
        assert outcome(os.path.exists, os.path.join(root, "a/never2.bin")) is False   # a miss
        assert outcome(_create, os.path.join(root, "a/new.bin")) == errno.EIO
        assert outcome(_write_and_close, os.path.join(root, "a/scratch.bin")) == errno.EIO
        assert outcome(os.listdir, os.path.join(root, "a")) == errno.EIO
        assert is_mounted(s.mnt)
    finally:
        _signal(pid, signal.SIGCONT)
    # back: the same mount serves again, the old bytes exactly, new writes too
    wait_serving(root)
    assert _read_until_served(reader) == old[:MiB]
    os.close(reader)
    assert llmd_read(root, "a/old.bin") == old
    fresh = pattern("fresh", 2 * MiB)
    assert _write_until_served(root, "a/fresh.bin", fresh)
    assert llmd_read(root, "a/fresh.bin") == fresh

    # stopped again, then killed and restarted: served again without a remount
    wait_settled(s.daemon)
    try:
        os.kill(pid, signal.SIGSTOP)
        assert outcome(os.stat, os.path.join(root, "a/never3.bin")) == errno.EIO
    finally:
        _signal(pid, signal.SIGKILL)
        _signal(pid, signal.SIGCONT)
    s.daemon.kill()
    assert outcome(os.stat, os.path.join(root, "a/never4.bin")) == errno.EIO
    s.daemon.start()
    wait_serving(root)
    assert _read_file_until_served(root, "a/old.bin") == old
    assert _read_file_until_served(root, "a/fresh.bin") == fresh


def test_what_the_kernel_answers_itself_goes_on_while_bluecached_is_stopped(mounted):
    """Passthrough reads of a file already open, read-only opens of a file hostd kept, and
    names and attributes the kernel holds, need neither daemon (docs/operations.md, Bounded
    I/O time)."""
    s = mounted(allow_log=DAEMON_STOPPED, hostd_settings={"daemon.request_timeout": "1s"})
    if "passthrough on" not in s.hostd.log.read_text():
        pytest.skip("the kernel did not negotiate FUSE passthrough here")
    root = str(s.mnt)
    data = pattern("pt", 2 * MiB)
    llmd_write(root, "c/pt.bin", data, "w")
    path = os.path.join(root, "c/pt.bin")
    size = os.stat(path).st_size              # the kernel now holds its entry and attributes
    fd = os.open(path, os.O_RDONLY)
    pid = s.daemon.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        assert outcome(lambda: os.stat(path).st_size) == size
        assert outcome(os.pread, fd, len(data), 0) == data
        # a read-only open of it is answered by hostd from the memory it kept
        again = os.open(path, os.O_RDONLY)
        try:
            assert outcome(os.pread, again, len(data), 0) == data
        finally:
            os.close(again)
        assert outcome(os.open, path, os.O_WRONLY) == errno.EIO   # this one needs bluecached
    finally:
        _signal(pid, signal.SIGCONT)
        os.close(fd)


def _retry(fn, *args, attempts: int = 100):
    """fn(*args) until it stops failing with EIO (hostd reconnects within a few pings)."""
    for _ in range(attempts):
        try:
            return fn(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            time.sleep(0.2)
    return fn(*args)


def _read_until_served(fd: int) -> bytes:
    return _retry(_read_fd, fd)


def _read_file_until_served(root: str, rel: str) -> bytes:
    return _retry(llmd_read, root, rel)


def _write_until_served(root: str, rel: str, data: bytes) -> bool:
    return _retry(llmd_write, root, rel, data, "r") or llmd_read(root, rel) == data


KERNEL_TIMEOUT_S = 3   # the check runs every 15 s in the kernel: the abort comes within ~18 s


def test_stopped_hostd_is_ended_by_the_kernels_request_timeout(mounted):
    s = mounted(hostd_settings={"daemon.request_timeout": "1s",
                                "mount.kernel_request_timeout": KERNEL_TIMEOUT_S})
    log = s.hostd.log.read_text()
    if f"kernel request timeout: {KERNEL_TIMEOUT_S} s" not in log:
        line = next((x for x in log.splitlines() if "kernel request timeout" in x),
                    "hostd logged nothing about it")
        pytest.skip(f"the kernel took no FUSE request timeout: {line}")
    root = str(s.mnt)
    data = pattern("k", 2 * MiB)
    llmd_write(root, "b/kept.bin", data, "w")
    pid = s.hostd.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        # blocked in the kernel until it gives up on hostd and aborts the connection
        # (ECONNABORTED here: the kernel ends what waits with it, later requests get ENOTCONN)
        assert outcome(os.stat, os.path.join(root, "b/never.bin")) in (errno.ECONNABORTED,
                                                                      errno.ENOTCONN)
        assert outcome(os.listdir, root) == errno.ENOTCONN   # aborted: the mount is dead
    finally:
        _signal(pid, signal.SIGCONT)
    # hostd, running again, finds its connection aborted and exits with an error (systemd
    # restarts it); the next hostd clears the dead mount and mounts again
    try:
        status = s.hostd.proc.wait(JOIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail("hostd did not exit after its FUSE connection was aborted:\n" +
                    "\n".join(s.hostd.log.read_text().splitlines()[-20:]))
    assert status != 0
    s.hostd.stop()   # reaped: only closes its notify socket
    h2 = HostdProcess(s.daemon, s.mnt).start()
    s.hostd = h2
    # Both write the same log. The first, resumed, may also find a request to bluecached it
    # had sent before the stop timed out (its clock jumped): it says so before it exits.
    h2.allowed_log = ["the kernel aborted the FUSE connection", "Traceback",
                      "clearing the mount a crashed hostd left", *DAEMON_STOPPED]
    assert "the kernel aborted the FUSE connection" in h2.log.read_text()
    assert llmd_read(root, "b/kept.bin") == data
