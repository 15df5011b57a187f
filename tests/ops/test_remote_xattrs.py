"""user.* extended attributes in the remote tier, against a real Ceph radosgw: carried with the
object (inline in its metadata, or a sidecar for values past the 2 KB metadata limit), seen by
another host, replaced when they change, gone with the object, and an object whose sidecar is
missing or not its own is never served."""

import errno
import threading
import time

import pytest
from test_remote import attach, find_path, serving, until

from bluecached.namespace import ROOT_INO, FsError
from bluecached.tiers.s3 import XATTRS_META, XATTRS_SIDECAR_META
from support import MiB, pattern

CRC = b"user.vllm.kv_crc32c"
BIG = pattern("xattr", 65536)


def _keys(ceph, bucket) -> set[str]:
    r = ceph.s3_client().list_objects_v2(Bucket=bucket[0])
    return {o["Key"] for o in r.get("Contents", [])}


def _meta(ceph, bucket, key: str) -> dict:
    return ceph.s3_client().head_object(Bucket=bucket[0], Key=key)["Metadata"]


def test_another_host_reads_the_block_with_its_attributes(harness, ceph, bucket):
    a, b = harness(), harness()
    ra, _ = attach(a, ceph, bucket), attach(b, ceph, bucket)
    small, large = pattern("s", 3 * MiB + 7), pattern("l", 2 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/m/small.bin_1.tmp", small)
        ino = a.store.ns.resolve("/m/small.bin_1.tmp").ino
        await a.store.setxattr(ino, CRC, b"12345")
        a.store.rename(a.store.ns.resolve("/m").ino, b"small.bin_1.tmp",
                       a.store.ns.resolve("/m").ino, b"small.bin")
        await a.put("/m/large.bin", large)
        node = a.store.ns.resolve("/m/large.bin")
        await a.store.setxattr(node.ino, b"user.big", BIG)
        await a.store.setxattr(node.ino, CRC, b"678")
        await until(lambda: ra.stats.uploads >= 2 and not ra.queue_length(), "two uploads")
        assert "m/small.bin_1.tmp" not in _keys(ceph, bucket)   # temp files stay local
        assert XATTRS_META in _meta(ceph, bucket, "m/small.bin")
        meta = _meta(ceph, bucket, "m/large.bin")
        assert XATTRS_SIDECAR_META in meta and XATTRS_META not in meta
        assert ra.sidecar_key("m/large.bin") in _keys(ceph, bucket)
        # B: the placeholders come with the attributes (their bytes are fetched, or being
        # prefetched)
        s = await find_path(b, "/m/small.bin")
        lg = await find_path(b, "/m/large.bin")
        assert b.store.getxattr(s.ino, CRC) == b"12345"
        assert b.store.listxattr(lg.ino) == [b"user.big", CRC]
        assert b.store.getxattr(lg.ino, b"user.big") == BIG
        assert await b.get("/m/small.bin") == small
        assert await b.get("/m/large.bin") == large
        # fetched, written behind on B: still the same attributes
        await until(lambda: b.store.tiers.dirty_bytes == 0, "write-behind on B")
        assert b.store.getxattr(lg.ino, b"user.big") == BIG


def test_a_change_replaces_the_remote_copy_and_unlink_deletes_the_sidecar(harness, ceph, bucket):
    a = harness()
    ra = attach(a, ceph, bucket)
    data = pattern("d", MiB)

    @serving(a)
    async def _():
        await a.put("/x.bin", data)
        ino = a.store.ns.resolve("/x.bin").ino
        await a.store.setxattr(ino, CRC, b"first")
        await until(lambda: ra.stats.uploads == 1, "the upload")
        await a.store.setxattr(ino, b"user.big", BIG)      # now it needs a sidecar
        await until(lambda: ra.stats.uploads == 2, "the upload with the new attributes")
        assert XATTRS_SIDECAR_META in _meta(ceph, bucket, "x.bin")
        await a.store.removexattr(ino, b"user.big")         # back inline
        await until(lambda: ra.stats.uploads == 3, "the third upload")
        assert XATTRS_META in _meta(ceph, bucket, "x.bin")
        await a.store.setxattr(ino, b"user.big", BIG)
        await until(lambda: ra.stats.uploads == 4, "the fourth upload")
        assert ra.sidecar_key("x.bin") in _keys(ceph, bucket)
        a.store.unlink(ROOT_INO, b"x.bin")
        await until(lambda: not _keys(ceph, bucket), "the object and its sidecar deleted")

    c = harness()
    attach(c, ceph, bucket)

    @serving(c)
    async def _():
        with pytest.raises(FsError) as e:
            await find_path(c, "/x.bin")
        assert e.value.errno == errno.ENOENT


def test_evicted_locally_the_block_comes_back_from_the_remote_tier_with_its_attributes(
        harness, ceph, bucket):
    a = harness()
    ra = attach(a, ceph, bucket)
    data = pattern("e", 2 * MiB)

    @serving(a)
    async def _():
        await a.put("/e.bin", data)
        await a.store.setxattr(a.store.ns.resolve("/e.bin").ino, b"user.big", BIG)
        await until(lambda: ra.stats.uploads == 1, "the upload")
        await until(lambda: a.store.tiers.dirty_bytes == 0, "write-behind")
        assert a.store.evict("/e.bin")["removed"] == 1      # gone from DRAM and NVMe
        node = await find_path(a, "/e.bin")
        assert a.store.tier_of(node) == "remote"
        assert a.store.getxattr(node.ino, b"user.big") == BIG
        assert await a.get("/e.bin") == data


@pytest.mark.parametrize("damage", ["deleted", "replaced"])
def test_an_object_whose_sidecar_is_not_its_own_is_never_served(harness, ceph, bucket, damage):
    a, b = harness(), harness()
    ra = attach(a, ceph, bucket)
    attach(b, ceph, bucket)

    @serving(a, b)
    async def _():
        await a.put("/s.bin", pattern("s", MiB))
        await a.store.setxattr(a.store.ns.resolve("/s.bin").ino, b"user.big", BIG)
        await until(lambda: ra.stats.uploads == 1, "the upload")
        sidecar = ra.sidecar_key("s.bin")
        s3 = ceph.s3_client()
        if damage == "deleted":
            s3.delete_object(Bucket=bucket[0], Key=sidecar)
        else:
            s3.put_object(Bucket=bucket[0], Key=sidecar, Body=b"\x90")   # another table
        with pytest.raises(FsError) as e:
            await find_path(b, "/s.bin")
        assert e.value.errno == errno.ENOENT


def test_an_upload_that_raced_a_change_of_attributes_is_replaced(harness, ceph, bucket):
    a = harness()
    ra = attach(a, ceph, bucket)
    started, gate = threading.Event(), threading.Event()
    put = ra.s3.put

    def held_put(*args):
        started.set()
        gate.wait(30)
        return put(*args)

    ra.s3.put = held_put
    delete = ra.s3.delete

    def slow_delete(key):
        time.sleep(0.5)   # the stale copy's delete comes late: it must not remove the new copy
        return delete(key)

    ra.s3.delete = slow_delete

    @serving(a)
    async def _():
        await a.put("/r.bin", pattern("r", MiB))
        ino = a.store.ns.resolve("/r.bin").ino
        await a.store.setxattr(ino, CRC, b"before")
        await until(started.is_set, "the upload to start")
        await a.store.setxattr(ino, CRC, b"after")     # while the upload is in flight
        gate.set()
        await until(lambda: ra.stats.uploads == 2 and not ra.queue_length(), "two uploads")
        node = a.store.ns.resolve("/r.bin")
        assert a.store.tier_of(node).endswith("+remote")

    c = harness()
    attach(c, ceph, bucket)

    @serving(c)
    async def _():
        node = await find_path(c, "/r.bin")
        assert c.store.getxattr(node.ino, CRC) == b"after"


def test_a_change_on_a_placeholder_fetches_it_and_uploads_it_again(harness, ceph, bucket):
    a, b = harness(), harness()
    ra, rb = attach(a, ceph, bucket), attach(b, ceph, bucket, prefetch=0)
    data = pattern("p", 3 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/p.bin", data)
        await a.store.setxattr(a.store.ns.resolve("/p.bin").ino, CRC, b"a's")
        await until(lambda: ra.stats.uploads == 1, "A's upload")
        node = await find_path(b, "/p.bin")
        assert b.store.tier_of(node) == "remote"
        await b.store.setxattr(node.ino, CRC, b"b's")
        assert b.store.tier_of(node).startswith("dram")    # fetched before its copy went
        await until(lambda: rb.stats.uploads == 1, "B's upload")
        assert await b.get("/p.bin") == data

    c = harness()
    attach(c, ceph, bucket)

    @serving(c)
    async def _():
        node = await find_path(c, "/p.bin")
        assert c.store.getxattr(node.ino, CRC) == b"b's"
        assert await c.get("/p.bin") == data
