"""hostd stops (SIGTERM, the mount detached lazily under busy writers) while writers keep going:
their writes must fail, not land "successfully" in the directory under the mountpoint on the
root disk, where the next mount would hide them (issue 16). hostd guards that directory: mode
000 (every user but root) and immutable (root too)."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import (
    AS_NOBODY,
    HostdProcess,
    MiB,
    force_unmount,
    is_mounted,
    let_others_reach,
    pattern,
)

BUSY = ["is busy: detaching it lazily"]     # hostd's stop under writers, as expected here
AFTER = 5           # attempts each writer makes once the mount is gone

# Runs as user nobody until killed: one file per attempt; prints "<phase> <errno> <name>"
# (errno 0: written). The phase is "after" once the test created the phase file, which it
# does only when the mount is gone.
_WRITER = r"""
import os, sys, time
root, phase_file = sys.argv[1], sys.argv[2]
i = 0
while True:
    phase = "after" if os.path.exists(phase_file) else "before"
    name = os.path.join(root, f"nobody-{i}.bin")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"n" * 65536)
        finally:
            os.close(fd)
        err = 0
    except OSError as e:
        err = e.errno
    print(phase, err, name, flush=True)
    i += 1
    time.sleep(0.02)
"""


def as_nobody(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*AS_NOBODY, sys.executable, *argv], **kw)


def nobody_creates(path) -> int:
    code = ("import os, sys\ntry:\n    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT))"
            "\n    print(0)\nexcept OSError as e:\n    print(e.errno)\n")
    p = as_nobody("-c", code, str(path), stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    return int(out)


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_writes_after_hostd_stops_fail_instead_of_landing_under_the_mountpoint(daemon,
                                                                                 tmp_path):
    mnt = tmp_path / "kv-cache"
    mnt.mkdir()
    os.chmod(mnt, 0o777)     # an operator made the (bare) mountpoint world-writable
    let_others_reach(mnt)
    phase_file = tmp_path / "unmounted"
    d = daemon().start()
    hostd = HostdProcess(d, mnt).start()
    hostd.allowed_log = BUSY
    root = str(mnt)
    os.chmod(mnt, 0o777)     # the mount's root: nobody writes there while it is mounted

    stop = threading.Event()
    unmounted = threading.Event()
    results: dict[str, list[tuple[str, int, str]]] = {}   # writer -> (phase, errno, name)

    def root_writer(k: int) -> None:
        out = results.setdefault(f"root{k}", [])
        i = k
        while not stop.is_set():
            phase = "after" if unmounted.is_set() else "before"
            try:
                llmd_write(root, block_name(i), pattern(f"b{i}", MiB), f"w{k}")
                out.append((phase, 0, block_name(i)))
            except OSError as e:
                out.append((phase, e.errno, block_name(i)))
            i += 2
            time.sleep(0.01)

    def read_nobody(proc) -> None:
        out = results.setdefault("nobody", [])
        with proc.stdout:
            for line in proc.stdout:
                phase, err, name = line.split()
                out.append((phase, int(err), os.path.basename(name)))

    writers = [threading.Thread(target=root_writer, args=(k,)) for k in range(2)]
    nobody = as_nobody("-c", _WRITER, root, str(phase_file), stdout=subprocess.PIPE, text=True)
    writers.append(threading.Thread(target=read_nobody, args=(nobody,)))
    try:
        for t in writers:
            t.start()
        wait_until(lambda: len(results) == 3 and all(
            sum(1 for r in out if r[1] == 0) >= 3 for out in results.values()),
            "every writer to write through the mount")

        assert hostd.stop() == 0                 # SIGTERM under busy writers
        assert not is_mounted(mnt)
        unmounted.set()
        phase_file.touch()
        wait_until(lambda: all(sum(1 for r in out if r[0] == "after") >= AFTER
                               for out in results.values()),
                   "writers to try again with the cache unmounted")
        stop.set()
        nobody.kill()
        for t in writers:
            t.join(60)

        after = {w: [r for r in out if r[0] == "after"] for w, out in results.items()}
        written = {w: [r for r in out if r[1] == 0] for w, out in after.items()}
        assert not any(written.values()), f"written with the cache unmounted: {written}"
        assert {r[1] for r in after["nobody"]} <= {errno.EACCES, errno.EPERM}, after["nobody"]
        assert os.listdir(mnt) == []             # nothing landed on the disk under the mount
        with pytest.raises(PermissionError):     # root included: the directory is immutable
            open(mnt / "direct.bin", "wb").close()
        with pytest.raises(PermissionError):
            os.mkdir(mnt / "llama_abc123_r0")
        assert nobody_creates(mnt / "direct.bin") in (errno.EACCES, errno.EPERM)

        # A restart mounts over the guarded directory as before; what was written through
        # the mount is there, and both users write again.
        hostd = HostdProcess(d, mnt).start()
        hostd.allowed_log = BUSY
        assert is_mounted(mnt)
        for w in ("root0", "root1"):
            for _, _, name in (r for r in results[w] if r[1] == 0):
                i = int(w[-1]) + 2 * next(j for j in range(10_000)
                                          if block_name(int(w[-1]) + 2 * j) == name)
                assert llmd_read(root, name) == pattern(f"b{i}", MiB), name
        assert llmd_write(root, "after/restart.bin", b"ok", "r")
        assert nobody_creates(mnt / "nobody-after-restart.bin") == 0
        assert hostd.stop() == 0
        assert not is_mounted(mnt) and os.listdir(mnt) == []
    finally:
        stop.set()
        nobody.kill()
        nobody.wait(60)
        for t in writers:
            t.join(60)
        hostd.stop(timeout=30)
        force_unmount(mnt)      # also lifts the guard, so that pytest can remove tmp_path
    bad = hostd.unexpected_log_lines(hostd.allowed_log)
    assert not bad, "unexpected warnings in hostd's log:\n" + "\n".join(bad)
