"""A read or write of a file already open, issued while bluecached is down, waits for the new
daemon and is then served there: its bytes travel through hostd's staging memory, which the
new daemon knows under a new region id, so the request must name that one, not the id of the
daemon it was first meant for (it failed with EINVAL: "no registered region")."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from support import MiB, pattern, wait_serving

GONE = ["lost bluecached", "is not listening"]
# passthrough off: every read of an open file reaches hostd (with it, a DRAM hit is read by
# the kernel from the memfd and never waits for bluecached)
THROUGH_HOSTD = {"mount.passthrough": False}

# The file is held open by a child process, not by the test: bluecached is started from the
# test's process, and a FUSE file open there would be closed in the new process at its exec,
# a FLUSH that waits for the writes pending in hostd, which wait for that very daemon.
CHILD = r"""
import os, sys
path, mode, bytes_file = sys.argv[1:4]
fd = os.open(path, os.O_RDONLY if mode == "read" else os.O_WRONLY)
first = os.read(fd, 1 << 20) if mode == "read" else b""
print("open", len(first), flush=True)
sys.stdin.readline()   # "go": bluecached is down now
try:
    if mode == "read":
        with open(bytes_file, "wb") as f:
            f.write(os.read(fd, 2 << 20))
    else:
        with open(bytes_file, "rb") as f:
            os.pwrite(fd, f.read(), 1 << 20)
        os.fsync(fd)
    os.close(fd)
except OSError as e:
    print("error", e.errno, flush=True)
else:
    print("ok", flush=True)
"""


def _across_a_restart(s, path: str, mode: str, bytes_file, sig=signal.SIGKILL,
                      after_open=None) -> str:
    """The child's line after it did its request while bluecached was stopped by `sig` and
    started: a read of 2 MiB into `bytes_file`, or a write of `bytes_file`'s bytes, then
    fsync. `after_open`: called once the child has the file open, before the stop."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, mode, str(bytes_file)],
                             text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().startswith("open")
        if after_open is not None:
            after_open()
        s.daemon.stop(sig)
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.5)   # the request is waiting in hostd for a daemon
        assert child.poll() is None
        s.daemon.start()
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return out.strip()


def test_a_read_waiting_out_a_restart_is_served_by_the_new_daemon(mounted, tmp_path):
    s = mounted(allow_log=GONE, hostd_settings=THROUGH_HOSTD)
    path = os.path.join(str(s.mnt), "block.bin")
    data = pattern("block", 3 * MiB)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    assert _across_a_restart(s, path, "read", tmp_path / "got") == "ok"
    assert (tmp_path / "got").read_bytes() == data[MiB:]


def test_a_read_of_a_file_gone_in_the_restarted_daemon_fails_estale(mounted, tmp_path):
    # Unlinked while open: a clean stop keeps no orphan, so the new daemon has no such inode.
    # The reader's handle is void (ESTALE, as NFS says it), not "no such file" (ENOENT),
    # which a connector takes for a block that was never stored.
    s = mounted(allow_log=GONE, hostd_settings=THROUGH_HOSTD)
    path = os.path.join(str(s.mnt), "block.bin")
    with open(path, "wb") as f:
        f.write(pattern("block", 3 * MiB))
    line = _across_a_restart(s, path, "read", tmp_path / "got", sig=signal.SIGTERM,
                             after_open=lambda: os.unlink(path))
    assert line == f"error {errno.ESTALE}"
    assert "gone since: ESTALE" in s.hostd.log.read_text()


@pytest.mark.parametrize("ack", ["staged", "stored"])
def test_a_write_waiting_out_a_restart_is_stored_by_the_new_daemon(mounted, ack, tmp_path):
    s = mounted(allow_log=GONE, hostd_settings={**THROUGH_HOSTD, "mount.write_ack": ack})
    path = os.path.join(str(s.mnt), "block.bin")
    old, new = pattern("old", 2 * MiB), pattern("new", MiB)
    with open(path, "wb") as f:
        f.write(old)
        os.fsync(f.fileno())
    # opened without O_TRUNC: hostd writes it, not the kernel into a memfd
    (tmp_path / "new").write_bytes(new)
    assert _across_a_restart(s, path, "write", tmp_path / "new") == "ok"
    wait_serving(str(s.mnt))
    with open(path, "rb") as f:
        assert f.read() == old[:MiB] + new
