"""Two complete embedded instances (two bluecached + hostd pairs, two state dirs, two mounts)
sharing one bucket on a real Ceph radosgw: the llm-d FS backend's syscall sequence on one host,
lookups and byte-exact reads on the other, restarts, radosgw killed mid-run, corruption."""

import errno
import os
import shutil
import subprocess
import sys
import time

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import MiB, force_unmount, pattern, wait_settled

BLOCK = 32 * MiB
DOWN_LOG = ("remote tier unreachable",)


def two_hosts(mounted, ceph, bucket, allow_log=(), **remote):
    name, creds = bucket
    settings = ceph.s3_settings(name, creds, retry_interval="1s", timeout="3s",
                                negative_ttl="2s", **remote)
    return (mounted(allow_log=allow_log, remote=settings),
            mounted(allow_log=allow_log, remote=settings))


def remote_stats(stack) -> dict:
    client = stack.daemon.client()
    try:
        return client.call("stats")["remote"]
    finally:
        client.close()


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_uploads(stack, count: int) -> None:
    wait_for(lambda: remote_stats(stack)["uploads"] >= count, f"{count} uploads")


def ctl_status(stack) -> str:
    return subprocess.run([sys.executable, "-m", "bluecached.ctl", "--state-dir",
                           str(stack.daemon.state_dir), "status"], capture_output=True,
                          text=True, check=True).stdout


def block(i: int) -> bytes:
    return pattern(f"block{i}", BLOCK)


def restart(stack, wipe_local: bool) -> None:
    """Stops hostd and bluecached; optionally loses the local tiers (a new pod, a new disk)."""
    stack.hostd.stop(timeout=30)
    force_unmount(stack.mnt)
    stack.daemon.stop(timeout=60)
    if wipe_local:
        shutil.rmtree(stack.daemon.root / "nvme")
    stack.daemon.start()
    stack.hostd.start()   # the same config: the same engine settings


def test_host_b_reads_what_host_a_wrote_and_survives_restarts(mounted, ceph, bucket):
    a, b = two_hosts(mounted, ceph, bucket)
    names = [block_name(i) for i in range(6)]
    # B asks for the first block before it exists: its kernel and its daemon cache the miss
    assert not os.path.exists(b.path(names[0]))
    for i, name in enumerate(names):
        assert llmd_write(a.mnt, name, block(i), tag=f"a{i}")
    wait_uploads(a, len(names))
    # ... and still sees it once uploaded (within the negative timeouts: docs/operations.md)
    wait_for(lambda: os.path.exists(b.path(names[0])), "B to see A's block", timeout=30)
    for i, name in enumerate(names):
        assert os.path.exists(b.path(name))
        assert os.stat(b.path(name)).st_size == BLOCK
        assert llmd_read(b.mnt, name) == block(i)
    assert remote_stats(b)["fetches"] == len(names)
    # B's dedup path (open + utimensat) on a block A wrote: no second copy, no upload
    assert not llmd_write(b.mnt, names[0], block(0), tag="b0")
    # B evicts everything; A's view is intact, and B gets the blocks back from S3
    client = b.daemon.client()
    assert client.call("evict", all=True)["removed"] >= len(names)
    client.close()
    wait_settled(b.daemon)
    for i, name in enumerate(names):
        assert llmd_read(a.mnt, name) == block(i)
    for i, name in enumerate(names[:2]):
        assert llmd_read(b.mnt, name) == block(i)
    assert remote_stats(b)["fetches"] == len(names) + 2
    assert remote_stats(b)["uploads"] == 0
    # both restart without their local tiers: every block comes back from the remote tier
    for stack in (a, b):
        restart(stack, wipe_local=True)
    for stack in (a, b):
        for i, name in enumerate(names):
            assert llmd_read(stack.mnt, name) == block(i)
        assert remote_stats(stack)["fetches"] == len(names)


def test_radosgw_killed_mid_run_local_tiers_keep_serving_and_the_tier_recovers(
        mounted, ceph, bucket):
    a, b = two_hosts(mounted, ceph, bucket, allow_log=DOWN_LOG)
    before = [block_name(i) for i in range(3)]
    during = [block_name(i) for i in range(3, 6)]
    for i, name in enumerate(before):
        llmd_write(a.mnt, name, block(i), tag="a")
    wait_uploads(a, len(before))
    assert llmd_read(b.mnt, before[0]) == block(0)     # B holds one of them locally

    ceph.kill_rgw()
    try:
        for i, name in enumerate(during, start=len(before)):
            assert llmd_write(a.mnt, name, block(i), tag="a")
        for i, name in enumerate(before + during):     # A serves everything from local tiers
            assert llmd_read(a.mnt, name) == block(i)
        assert llmd_read(b.mnt, before[0]) == block(0)  # B: what it holds
        for name in during + before[1:]:               # B: the rest is a miss, never an error
            assert not os.path.exists(b.path(name))
        wait_for(lambda: not remote_stats(a)["up"], "A to notice")
        assert "UNREACHABLE" in ctl_status(a)
        assert remote_stats(a)["queue_length"] >= 1
        assert not remote_stats(b)["up"]
    finally:
        ceph.start_rgw()

    wait_for(lambda: remote_stats(a)["up"] and remote_stats(b)["up"], "recovery")
    wait_uploads(a, len(before) + len(during))
    assert remote_stats(a)["queue_length"] == 0 and remote_stats(a)["uploads_dropped"] == 0
    assert "reachable" in ctl_status(a) and "UNREACHABLE" not in ctl_status(a)
    for i, name in enumerate(before + during):
        wait_for(lambda name=name: os.path.exists(b.path(name)), f"B to see {name}", timeout=30)
        assert llmd_read(b.mnt, name) == block(i)


def test_corrupted_remote_object_is_detected_and_never_served(mounted, ceph, bucket):
    a, b = two_hosts(mounted, ceph, bucket,
                     allow_log=("failed its checksum", "-> EIO", "remote fetch failed"))
    name = block_name(0)
    data = block(0)
    llmd_write(a.mnt, name, data, tag="a")
    wait_uploads(a, 1)
    s3 = ceph.s3_client()
    key = name
    meta = s3.head_object(Bucket=bucket[0], Key=key)["Metadata"]
    bad = bytearray(data)
    bad[17 * MiB] ^= 1
    s3.put_object(Bucket=bucket[0], Key=key, Body=bytes(bad), Metadata=meta)

    assert os.path.exists(b.path(name))
    with pytest.raises(OSError) as e:
        llmd_read(b.mnt, name)
    assert e.value.errno == errno.EIO
    assert remote_stats(b)["checksum_failures"] == 1
    # the bad object is gone from the bucket; B now simply misses; A still has the good bytes
    wait_for(lambda: not os.path.exists(b.path(name)), "B's miss", timeout=30)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket[0], Prefix=key)
    assert llmd_read(a.mnt, name) == data
