"""Ownership and permission bits through the kernel, as a second, unprivileged user sees them."""

import errno
import os
import signal
import subprocess
import sys

import pytest

from support import force_unmount

NOBODY = 65534      # user nobody, group nogroup on Debian

# Runs as user nobody: creates and writes a file, prints the errno it got (0: it succeeded).
_WRITE = r"""
import os, sys
try:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"written by nobody")
    finally:
        os.close(fd)
    print(0)
except OSError as e:
    print(e.errno)
"""


def as_nobody(code: str, *args: str) -> str:
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                          "--clear-groups", sys.executable, "-c", code, *args],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def let_others_reach(path: str) -> None:
    """pytest's temp directories are 0700: let user nobody walk down to the mount."""
    d = os.path.dirname(path)
    while d not in ("/", ""):
        mode = os.stat(d).st_mode
        if not mode & 0o001:
            os.chmod(d, (mode & 0o7777) | 0o001)
        d = os.path.dirname(d)


def restart(stack, sig: int) -> None:
    """hostd stopped and bluecached stopped by `sig` (SIGTERM: clean; SIGKILL: journal replay),
    both started again: a fresh kernel mount, nothing cached from before."""
    stack.hostd.stop(timeout=30)
    force_unmount(stack.mnt)
    stack.daemon.stop(sig, timeout=60)
    stack.daemon.start()
    stack.hostd.start()


def root_attrs(root: str) -> tuple:
    st = os.stat(root)
    return st.st_mode, st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns


def test_chown_and_chmod_of_the_mount_root_survive_restarts(mounted):
    """README: the operator chowns/chmods /mnt/kv-cache so vLLM's user can write. That must
    hold after bluecached restarts, cleanly (snapshot) or killed (journal replay)."""
    s = mounted()
    root = str(s.mnt)
    let_others_reach(root)
    steps = [
        # (owner, group, mode, how bluecached stops): nobody can write as owner, then as group
        (NOBODY, NOBODY, 0o700, signal.SIGTERM),
        (0, NOBODY, 0o2770, signal.SIGKILL),
        (NOBODY, 0, 0o1755, signal.SIGTERM),
    ]
    for i, (uid, gid, mode, sig) in enumerate(steps):
        os.chown(root, uid, gid)
        os.chmod(root, mode)
        assert as_nobody(_WRITE, os.path.join(root, f"before{i}")) == "0"
        os.utime(root, ns=(1_000_000_000 * (i + 1), 2_000_000_000 * (i + 1)))
        before = root_attrs(root)
        assert before[:3] == (0o40000 | mode, uid, gid)
        restart(s, sig)
        assert root_attrs(root) == before, f"step {i}: the root's attributes changed"
        assert as_nobody(_WRITE, os.path.join(root, f"after{i}")) == "0"
    os.chmod(root, 0o755)
    os.chown(root, 0, 0)
    assert as_nobody(_WRITE, os.path.join(root, "refused")) == str(errno.EACCES)
    restart(s, signal.SIGKILL)
    assert as_nobody(_WRITE, os.path.join(root, "refused")) == str(errno.EACCES)


@pytest.fixture
def engine():
    """Permissions are the kernel's and the namespace's business, not the DMA engine's."""
    return "loopback"
