"""A writer whose kernel writes bluecached's memfd directly (passthrough) while bluecached is
killed and restarted: its bytes went to memory the new daemon never had, so its close must
fail (EIO) and no name may ever show those bytes as a complete file."""

import errno
import os
import signal
import subprocess
import sys

import pytest

from support import MiB, pattern, wait_settled

GONE = ["lost bluecached", "-> EIO", "not delivered", "restarted while inode",
        "went away before closing it", "not persisted with this stop"]


def test_a_kernel_writer_across_a_bluecached_restart_fails_its_close(mounted):
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "1GiB"})
    root = str(s.mnt)
    kept = pattern("kept", 4 * MiB)
    with open(os.path.join(root, "kept.bin"), "wb") as f:
        f.write(kept)
    wait_settled(s.daemon)                 # written behind: it survives the kill
    tmp, final = os.path.join(root, "block.tmp"), os.path.join(root, "block.bin")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, pattern("lost", 2 * MiB))
        s.daemon.kill()
        s.daemon.start()                   # hostd reconnects by itself
        os.write(fd, pattern("lost", 2 * MiB))   # the kernel still writes the old memfd
    finally:
        with pytest.raises(OSError) as e:
            os.close(fd)
    assert e.value.errno == errno.EIO
    with pytest.raises(FileNotFoundError):   # vLLM renames after its close: the tmp is gone
        os.rename(tmp, final)
    assert not os.path.exists(final)
    with open(os.path.join(root, "kept.bin"), "rb") as f:
        assert f.read() == kept


# llm-d's store in a child process (the test's own process starts bluecached: a FUSE file
# open there is closed in the new process at its exec, a FLUSH that waits for that daemon)
LLMD_CHILD = r"""
import errno, os, sys
tmp, final = sys.argv[1:3]
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
os.write(fd, b"a" * (2 << 20))
print("written", flush=True)
sys.stdin.readline()   # "go": bluecached restarted
os.write(fd, b"b" * (2 << 20))   # into the old daemon's memfd
results = []
for step in (lambda: os.rename(tmp, final), lambda: os.close(fd)):
    try:
        step()
        results.append("ok")
    except OSError as e:
        results.append(errno.errorcode[e.errno])
print(*results, flush=True)
"""


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_llmd_renaming_a_kernel_written_file_across_a_restart_publishes_nothing(mounted, stop):
    """llm-d renames its temporary onto the final name while the fd is still open, then
    closes (../shared/facts/posix-clients.md). A restart between its write and the rename
    leaves the kernel writing a memfd the new daemon never had: whether bluecached stopped
    cleanly or was killed, the rename must not publish what the old daemon held of it (a
    SIGTERM once persisted the memfd as it was, and the rename then showed a 0-byte or
    partial block under the final name, which llm-d would load as a success)."""
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "1GiB"})
    tmp, final = os.path.join(s.mnt, "block.bin_1a2b.tmp"), os.path.join(s.mnt, "block.bin")
    child = subprocess.Popen([sys.executable, "-c", LLMD_CHILD, tmp, final], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "written"
        s.daemon.stop(signal.SIGTERM) if stop == "SIGTERM" else s.daemon.kill()
        s.daemon.start()                   # hostd reconnects by itself
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert out.split() == ["ENOENT", "EIO"]   # rename: the tmp is gone; close: bytes lost
    assert not os.path.exists(final) and not os.path.exists(tmp)
