"""The mount under two standard POSIX torture tools, run for real: stress-ng's filesystem and
I/O stressors with `--verify` (many kinds of operation at once, each checking what it reads
back), and fio's checksummed writes through four I/O engines, verified again after bluecached
was SIGKILLed (every file was fsynced at close). The connectors use a few of these calls; a
user's tools use the rest. stress-ng found three bugs here (the kernel writer's stop, its
sparse writes, overlapping journal syncs: tests/ops/test_object_memfds.py, test_journal.py).
Both tools come from Debian (scripts/setup.sh --test)."""

import os
import shutil
import subprocess

import pytest

from support import wait_serving

# A DRAM tier that holds every stressor's files at once: a file is written whole in DRAM, and
# one past what it can hold is stopped (EPERM from write(2): a stressor failure, by design).
SETTINGS = {"tiers.dram.size": "1GiB", "tiers.nvme.size": "2GiB"}
GONE = ["lost bluecached", "-> EIO", "not delivered"]

# Run together, one instance each: operations on one directory tree race as a busy host's do.
BATCHES = {
    "names": "dentry dir dirdeep dirmany filename link symlink rename mknod getdent access "
             "chmod chown utime touch fstat open xattr",
    "locks": "fcntl flock lockf locka lockofd",
    "data": "hdd fallocate iomix sync-file copy-file sendfile splice seek readahead mmap "
            "msync fpunch fiemap aio aiol",
}
SMALL = ["--hdd-bytes", "16M", "--fallocate-bytes", "16M", "--iomix-bytes", "16M",
         "--sync-file-bytes", "16M", "--readahead-bytes", "16M", "--mmap-bytes", "16M",
         "--mmap-file", "--msync-bytes", "16M", "--seek-size", "16M"]


@pytest.fixture
def engine():
    """The engine is below all of this: the loopback one only."""
    return "loopback"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/setup.sh --test installs it)")
    return path


def _stress(root: str, stressors: list[str], seconds: int, *extra: str):
    cmd = [_tool("stress-ng"), "--temp-path", root, "--timeout", str(seconds), "--verify",
           *extra]
    for s in stressors:
        cmd += [f"--{s}", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 60)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_stress_ng_stressors_pass_on_the_mount(mounted, batch):
    s = mounted(**SETTINGS)
    root = os.path.join(str(s.mnt), "stress")
    os.mkdir(root)
    r = _stress(root, BATCHES[batch].split(), 6, *SMALL)
    failed = [line for line in r.stderr.splitlines() + r.stdout.splitlines()
              if " fail: " in line or " error: " in line]
    assert r.returncode == 0 and not failed, "\n".join(failed) or r.stderr[-2000:]
    assert s.daemon.proc.poll() is None and s.hostd.proc.poll() is None


def test_stressors_that_must_fail_here_do_the_daemons_no_harm(mounted):
    """fsize writes past RLIMIT_FSIZE and far past the end, the default-size hdd and fallocate
    write 1 GiB files each: more than a file here may hold, so their writes are stopped (EPERM,
    then ENOSPC or EFBIG: docs/operations.md) and the stressors report failures. What counts
    is that both daemons live and log no error, and that the mount serves on. (fsize ended
    bluecached once, when the watch of kernel writers looked between its far write and the
    truncate after it: timing, so tests/faults/test_oversized.py checks that one for sure.)"""
    s = mounted(**{"tiers.dram.size": "512MiB", "tiers.nvme.size": "2GiB"})   # 16 GiB files
    root = os.path.join(str(s.mnt), "stress")
    os.mkdir(root)
    r = _stress(root, ["fsize", "hdd", "fallocate"], 6)
    assert "fsize: " in r.stderr + r.stdout, "the stressors did not run"
    assert s.daemon.proc.poll() is None, "bluecached died"
    assert s.hostd.proc.poll() is None, "hostd died"
    with open(os.path.join(str(s.mnt), "after.bin"), "wb") as f:
        f.write(b"still serving")
    with open(os.path.join(str(s.mnt), "after.bin"), "rb") as f:
        assert f.read() == b"still serving"


FIO_JOBS = """
[global]
directory={root}
size=24m
verify=crc32c
verify_fatal=1
fsync_on_close=1
[buffered]
rw=randwrite
ioengine=psync
bsrange=4k-1m
[direct]
rw=randwrite
direct=1
ioengine=libaio
iodepth=8
bs=128k
[mmap]
rw=randwrite
ioengine=mmap
bs=64k
[uring]
rw=randwrite
ioengine=io_uring
iodepth=8
bs=256k
"""


def test_fio_verified_writes_survive_a_sigkill_of_bluecached(mounted, tmp_path):
    s = mounted(allow_log=GONE, **SETTINGS)
    root = os.path.join(str(s.mnt), "fio")
    os.mkdir(root)
    jobs = tmp_path / "jobs.fio"
    jobs.write_text(FIO_JOBS.format(root=root))
    fio = [_tool("fio"), str(jobs), "--output-format=terse"]
    r = subprocess.run([*fio, "--do_verify=0"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    s.daemon.kill()   # at once: only the fsync at each close made the files durable
    s.daemon.start()
    wait_serving(str(s.mnt))
    r = subprocess.run([*fio, "--verify_only"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # terse v3: field 5 is each job's error; four jobs, none failed
    results = [line.split(";") for line in r.stdout.splitlines() if line.startswith("3;")]
    assert [(job[2], job[4]) for job in results] == [
        ("buffered", "0"), ("direct", "0"), ("mmap", "0"), ("uring", "0")]
