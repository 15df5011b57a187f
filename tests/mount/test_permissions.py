"""Ownership and permission bits through the kernel, as a second, unprivileged user sees them."""

import errno
import os
import signal
import subprocess
import sys

import pytest

from support import AS_NOBODY, NOBODY, force_unmount, let_others_reach

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
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", code, *args],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


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


# Runs as user nobody: one operation on a file, prints the errno it got (0: it succeeded).
_ON_FILE = r"""
import os, sys
path, op = sys.argv[1], sys.argv[2]
try:
    if op == "write":
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"written", 1)
        finally:
            os.close(fd)
    elif op == "truncate":
        os.truncate(path, 3)
    elif op == "ftruncate":
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, 100)
        finally:
            os.close(fd)
    elif op == "o_trunc":
        os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    print(0)
except OSError as e:
    print(e.errno)
"""

SETID_OPS = ["write", "truncate", "ftruncate", "o_trunc"]


def _setid_case(directory: str, name: str, mode: int, owner: int, op: str, by: str) -> int:
    """Creates a file of `mode` owned by `owner`, has `by` (root or nobody) do `op` on it,
    returns the mode it is left with."""
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"content")
    os.chown(path, owner, owner)
    os.chmod(path, mode)
    assert os.stat(path).st_mode & 0o7777 == mode
    if by == "root":
        out = subprocess.run([sys.executable, "-c", _ON_FILE, path, op], capture_output=True,
                             text=True, timeout=120, check=True).stdout.strip()
    else:
        out = as_nobody(_ON_FILE, path, op)
    assert out == "0", f"{op} of a {mode:o} file by {by}: errno {out}"
    return os.stat(path).st_mode & 0o7777


# (mode, owner, who writes): the writer can write in each
SETID_CASES = [
    (0o4777, 0, "nobody"), (0o2777, 0, "nobody"), (0o6777, 0, "nobody"), (0o2757, NOBODY, "nobody"),
    (0o4755, NOBODY, "nobody"),   # its owner, unprivileged: the bit goes all the same
    (0o4777, 0, "root"), (0o6777, 0, "root"), (0o4755, NOBODY, "root"),   # CAP_FSETID: kept
]


@pytest.fixture
def tmpfs_dir(tmp_path):
    """A directory on tmpfs that user nobody can reach: the reference for the expected modes."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0777", "tmpfs", str(d)],
                   check=True)
    let_others_reach(str(d))
    yield str(d)
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("op, hostd", [
    *((op, {}) for op in SETID_OPS),
    # each way a write reaches bluecached: in place or copied, answered staged or stored
    ("write", {"mount.receive_in_place": False}),
    ("write", {"mount.write_ack": "stored"}),
    ("write", {"mount.receive_in_place": False, "mount.write_ack": "stored"}),
], ids=lambda v: v if isinstance(v, str)
   else ",".join(f"{k.split('.')[-1]}={x}" for k, x in v.items()) or "default")
def test_write_or_truncate_by_an_unprivileged_user_clears_setuid_and_setgid(mounted, tmpfs_dir,
                                                                          op, hostd):
    """As on any Linux file system (tmpfs here, the same sequence side by side): a write or
    truncate by a user without CAP_FSETID clears S_ISUID, and S_ISGID when group-executable;
    root's keeps them."""
    s = mounted(hostd_settings=hostd)
    root = str(s.mnt)
    let_others_reach(root)
    os.chmod(root, 0o777)
    want = {}
    for i, (mode, owner, by) in enumerate(SETID_CASES):
        on_tmpfs = _setid_case(tmpfs_dir, f"f{i}", mode, owner, op, by)
        on_mount = _setid_case(root, f"f{i}", mode, owner, op, by)
        want[(mode, owner, by)] = on_tmpfs
        assert on_mount == on_tmpfs, \
            f"{op} by {by} of a {mode:o} file owned by {owner}: {on_mount:o}, tmpfs {on_tmpfs:o}"
    # what tmpfs did, spelled out (the comparison above must not pass on an odd reference)
    assert want[(0o4777, 0, "nobody")] == want[(0o2777, 0, "nobody")] == 0o777
    assert want[(0o4755, NOBODY, "nobody")] == 0o755
    assert want[(0o4777, 0, "root")] == 0o4777 and want[(0o6777, 0, "root")] == 0o6777
