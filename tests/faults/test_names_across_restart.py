"""Names the kernel still holds when bluecached restarts under the mount (hostd's mount stays,
and with it the kernel's cached names and inode numbers, for `mount.entry_timeout`).

Run with the NVMe tier off, where a restart keeps no file at all: every name the kernel
holds then names a file the new daemon does not have. Before, a daemon without a journal
started its inode numbers over, so the first file made after the restart took the number of
the first one before it, and the old name read the new file's bytes; and a name whose file
went failed an O_CREAT open with ENOENT until the kernel's entry timed out."""

import errno
import os
import signal

import pytest

from support import MiB, pattern, wait_serving

GONE = ["lost bluecached", "is not listening"]
NO_NVME = {"tiers.nvme.size": 0}


def _restart(s, sig) -> None:
    s.daemon.stop(sig)
    s.daemon.start()
    wait_serving(str(s.mnt))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_name_held_across_a_restart_never_reads_another_files_bytes(mounted, sig):
    s = mounted(allow_log=GONE, **NO_NVME)
    old, new = s.path("old.bin"), s.path("new.bin")
    old.write_bytes(pattern("old", MiB))
    old_ino = os.stat(old).st_ino            # the kernel holds the name and its number
    _restart(s, sig)
    new.write_bytes(pattern("new", MiB))
    assert os.stat(new).st_ino != old_ino
    with pytest.raises(FileNotFoundError):
        old.read_bytes()
    assert not old.exists()
    assert new.read_bytes() == pattern("new", MiB)
    assert sorted(os.listdir(s.mnt)) == ["new.bin"]


def test_a_name_whose_file_went_at_a_restart_can_be_created_again_at_once(mounted):
    s = mounted(allow_log=GONE, **NO_NVME)
    tmp, d = s.path("block.bin.tmp"), s.path("d")
    tmp.write_bytes(b"before")
    d.mkdir()
    (d / "f.bin").write_bytes(b"before")
    os.stat(d / "f.bin")
    _restart(s, signal.SIGKILL)
    # a writer's temporary under the same name: llm-d's open (was ENOENT for entry_timeout)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"after")
    finally:
        os.close(fd)
    assert tmp.read_bytes() == b"after"
    # its directory went too: ENOENT, as for any missing directory; made again, it serves
    with pytest.raises(OSError) as e:
        os.open(d / "f.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    assert e.value.errno == errno.ENOENT
    d.mkdir()
    (d / "f.bin").write_bytes(b"after")
    assert (d / "f.bin").read_bytes() == b"after"
