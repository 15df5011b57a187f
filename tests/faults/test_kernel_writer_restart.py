"""A writer whose kernel writes bluecached's memfd directly (passthrough) while bluecached is
killed and restarted: its bytes went to memory the new daemon never had, so its close must
fail (EIO) and no name may ever show those bytes as a complete file."""

import os
import signal
import subprocess
import sys

import pytest

from support import MiB, pattern, wait_settled

GONE = ["lost bluecached", "-> EIO", "not delivered", "restarted while inode",
        "went away before closing it", "not persisted with this stop"]


# A connector's store in a child process (the test's own process starts bluecached: a FUSE
# file open there is closed in the new process at its exec, a FLUSH that waits for that
# daemon). vLLM closes, then renames; llm-d renames while the fd is still open, then closes.
STORE_CHILD = r"""
import errno, os, sys
tmp, final, connector = sys.argv[1:4]
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
os.write(fd, b"a" * (2 << 20))
print("written", flush=True)
sys.stdin.readline()   # "go": bluecached restarted
os.write(fd, b"b" * (2 << 20))   # into the old daemon's memfd
rename, close = lambda: os.rename(tmp, final), lambda: os.close(fd)
results = []
for step in ((rename, close) if connector == "llmd" else (close, rename)):
    try:
        step()
        results.append("ok")
    except OSError as e:
        results.append(errno.errorcode[e.errno])
print(*results, flush=True)
"""


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("connector", ["vllm", "llmd"])
def test_a_kernel_writer_across_a_restart_fails_its_close_and_publishes_nothing(
        mounted, connector, stop):
    """A restart between a store's write and its end leaves the kernel writing a memfd the
    new daemon never had: whether bluecached stopped cleanly or was killed, the close fails
    and the rename finds no temporary, so nothing of it shows under the final name. For
    llm-d (rename before close, ../shared/facts/posix-clients.md) a SIGTERM once persisted
    the memfd as it was, and the rename then showed a 0-byte or partial block under the
    final name, which llm-d would load as a success."""
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "1GiB"})
    kept = pattern("kept", 4 * MiB)
    with open(os.path.join(s.mnt, "kept.bin"), "wb") as f:
        f.write(kept)
    wait_settled(s.daemon)                 # written behind: it survives the kill
    tmp, final = os.path.join(s.mnt, "block.bin_1a2b.tmp"), os.path.join(s.mnt, "block.bin")
    child = subprocess.Popen([sys.executable, "-c", STORE_CHILD, tmp, final, connector],
                             text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "written"
        s.daemon.stop(signal.SIGTERM) if stop == "SIGTERM" else s.daemon.kill()
        s.daemon.start()                   # hostd reconnects by itself
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # the close: the bytes are lost (EIO); the rename: the temporary is gone (ENOENT)
    assert out.split() == (["ENOENT", "EIO"] if connector == "llmd" else ["EIO", "ENOENT"])
    assert not os.path.exists(final) and not os.path.exists(tmp)
    with open(os.path.join(s.mnt, "kept.bin"), "rb") as f:
        assert f.read() == kept
