"""The remote tier's logic, called directly (no sockets, no mount) against a real Ceph radosgw:
upload and fetch, admission policies, the queue bound, the negative cache, capacity bounds,
checksum failures, unreachability, and the journal's record of what is uploaded."""

import errno
import os
import socket
import stat
import threading

import crc32c
import pytest
import trio

from bluecached import config
from bluecached.compose import StartupError, add_remote_tier, open_bucket
from bluecached.crc import chunk_crcs
from bluecached.namespace import ROOT_INO, FsError
from bluecached.tiers.s3 import CHUNKS_META, CRC_META, SIZE_META, load_credentials, make_client
from support import MiB, pattern, run


def attach(h, ceph, bucket, **remote):
    name, creds = bucket
    settings = {"remote.enabled": True, "remote.endpoint": ceph.endpoint, "remote.bucket": name,
                "remote.credentials_file": str(creds), "remote.addressing_style": "path",
                "remote.multipart_threshold": "16MiB", "remote.part_size": "8MiB"}
    settings.update({f"remote.{k}": v for k, v in remote.items()})
    return add_remote_tier(h.store, config.load_config(None, settings).remote)


async def until(condition, what: str, timeout: float = 60) -> None:
    """Polls: the conditions are counters of background tasks that signal nothing."""
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await trio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def serving(*harnesses):
    """Runs fn(*harnesses) with every harness's background tasks, the remote tier's included."""
    def decorate(fn):
        async def main():
            async with trio.open_nursery() as nursery:
                for h in harnesses:
                    tiers = h.store.tiers
                    for _ in range(2):
                        nursery.start_soon(tiers.writeback_worker)
                    nursery.start_soon(tiers.evictor)
                    if h.store.remote is not None:
                        await nursery.start(h.store.remote.run)
                        h.store.remote.admit_persisted()
                result = await fn()
                nursery.cancel_scope.cancel()
            return result
        return run(main)
    return decorate


async def find_path(h, path: str):
    ino = ROOT_INO
    node = None
    for part in path.strip("/").split("/"):
        node = await h.store.find(ino, part.encode())
        ino = node.ino
    return node


def hold_fetch_after_chunk(remote, index: int) -> threading.Event:
    """Makes the remote tier's downloads stop after checking chunk `index` until the returned
    event is set (the real S3 download, held in its worker thread)."""
    gate = threading.Event()
    download = remote.s3.get_into

    def held(key, info, views, chunk_size, on_chunk, opened=None):
        def checked(i):
            on_chunk(i)
            if i == index:
                gate.wait(30)
        return download(key, info, views, chunk_size, checked, opened)

    remote.s3.get_into = held
    return gate


def dead_endpoint() -> str:
    """A loopback port nothing listens on: connections are refused (the endpoint is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_block_written_on_one_host_is_found_and_read_on_another(harness, ceph, bucket):
    a, b = harness(), harness()
    ra, rb = attach(a, ceph, bucket), attach(b, ceph, bucket)
    big, small = pattern("big", 32 * MiB + 12345), pattern("small", 4000)

    @serving(a, b)
    async def _():
        await a.put("/model/x/big.bin", big)
        await a.put("/model/x/small.bin", small)
        await until(lambda: ra.stats.uploads == 2, "two uploads")
        node = a.store.ns.resolve("/model/x/big.bin")
        assert a.store.tier_of(node).endswith("+remote")
        head = ceph.s3_client().head_object(Bucket=bucket[0], Key="model/x/big.bin")
        assert head["ContentLength"] == len(big)
        assert head["Metadata"][SIZE_META] == str(len(big))
        # B: the directories and the files come from the remote tier
        node = await find_path(b, "/model/x/big.bin")
        assert node.size == len(big) and b.store.tier_of(node) == "remote"
        assert await b.get("/model/x/big.bin") == big
        assert b.store.tier_of(node).startswith("dram+")   # a read to the end: all attached
        assert b.store.tier_of(node).endswith("+remote")
        assert await b.get("/model/x/big.bin") == big   # now from DRAM
        await find_path(b, "/model/x/small.bin")
        assert await b.get("/model/x/small.bin") == small
        assert rb.stats.fetches == 2 and rb.stats.fetch_bytes == len(big) + len(small)
        # fetched blocks go down to B's NVMe and are not uploaded again
        await until(lambda: b.store.tiers.dirty_bytes == 0, "write-behind on B")
        assert b.store.tier_of(node) == "dram+nvme+remote"
        # the CRCs checked on arrival (B) and computed for the upload (A) are what NVMe keeps
        await until(lambda: a.store.tiers.dirty_bytes == 0, "write-behind on A")
        for h in (a, b):
            assert h.store.ns.resolve("/model/x/big.bin").obj.crcs == chunk_crcs([big], MiB)
        assert rb.stats.uploads == 0 and rb.queue_length() == 0
    a.check_consistency()
    b.check_consistency()


def test_lookup_misses_are_cached_for_negative_ttl(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket, negative_ttl="1s")
    s3 = ceph.s3_client()

    @serving(h)
    async def _():
        with pytest.raises(FsError) as e:
            await h.store.find(ROOT_INO, b"later.bin")
        assert e.value.errno == errno.ENOENT
        assert (remote.stats.misses, remote.stats.negative_hits) == (1, 0)
        s3.put_object(Bucket=bucket[0], Key="later.bin", Body=b"x" * 10,
                      Metadata={CRC_META: "00000000"})
        for _ in range(50):   # a connector's burst of lookups: none reaches S3
            with pytest.raises(FsError):
                await h.store.find(ROOT_INO, b"later.bin")
        assert (remote.stats.misses, remote.stats.negative_hits) == (1, 50)
        await trio.sleep(1.1)   # past negative_ttl the next lookup asks again
        node = await h.store.find(ROOT_INO, b"later.bin")
        assert node.size == 10 and remote.stats.hits == 1


def test_a_corrupted_remote_object_is_never_served(harness, ceph, bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)   # the read's own fetch finds it
    data = pattern("good", 3 * MiB)
    s3 = ceph.s3_client()

    @serving(a, b)
    async def _():
        await a.put("/blk.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        meta = s3.head_object(Bucket=bucket[0], Key="blk.bin")["Metadata"]
        bad = bytearray(data)
        bad[MiB + 7] ^= 0x40          # one flipped bit, same size, same checksum metadata
        s3.put_object(Bucket=bucket[0], Key="blk.bin", Body=bytes(bad), Metadata=meta)
        await find_path(b, "/blk.bin")
        with pytest.raises(FsError) as e:
            await b.get("/blk.bin")
        assert e.value.errno == errno.EIO
        assert rb.stats.checksum_failures == 1
        # removed here and deleted there: the next lookup is a plain miss
        with pytest.raises(FsError):
            b.store.ns.resolve("/blk.bin")
        assert "Contents" not in s3.list_objects_v2(Bucket=bucket[0], Prefix="blk.bin")
        # an object without bluecache's checksum is not served either
        s3.put_object(Bucket=bucket[0], Key="foreign.bin", Body=b"no checksum here")
        await find_path(b, "/foreign.bin")
        with pytest.raises(FsError) as e:
            await b.get("/foreign.bin")
        assert e.value.errno == errno.EIO and rb.stats.checksum_failures == 2
        assert await a.get("/blk.bin") == data   # A's local copy is untouched


def test_admission_reread_uploads_only_blocks_read_again(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket, admission="reread")
    s3 = ceph.s3_client()

    @serving(h)
    async def _():
        for i in range(3):
            await h.put(f"/b{i}.bin", pattern(f"r{i}", MiB))
        await until(lambda: h.store.tiers.dirty_bytes == 0, "write-behind")
        assert remote.queue_length() == 0 and remote.stats.uploads == 0
        assert await h.get("/b1.bin") == pattern("r1", MiB)
        await until(lambda: remote.stats.uploads == 1, "the upload of the re-read block")
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket[0]).get("Contents", [])]
        assert keys == ["b1.bin"]


def test_admission_by_age_uploads_blocks_still_cached_after_the_age(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket, admission="age", admission_age="1s")

    @serving(h)
    async def _():
        await h.put("/old.bin", pattern("old", MiB))
        await h.put("/gone.bin", pattern("gone", MiB))
        h.store.unlink(ROOT_INO, b"gone.bin")   # not cached any more when its age comes
        assert remote.queue_length() == 0 and remote.stats.uploads == 0
        await until(lambda: remote.stats.uploads == 1, "the aged upload")
        await trio.sleep(0.5)
        assert remote.stats.uploads == 1
        assert h.store.tier_of(h.store.ns.resolve("/old.bin")).endswith("+remote")


def test_queue_is_bounded_while_unreachable_and_lookups_miss_at_once(harness, bucket):
    h = harness()
    name, creds = bucket
    settings = {"remote.enabled": True, "remote.endpoint": dead_endpoint(),
                "remote.bucket": name, "remote.credentials_file": str(creds),
                "remote.addressing_style": "path", "remote.queue_max": 3,
                "remote.timeout": "1s", "remote.retry_interval": "1s"}
    add_remote_tier(h.store, config.load_config(None, settings).remote)
    remote = h.store.remote

    @serving(h)
    async def _():
        assert not remote.reachable and remote.last_error
        for i in range(5):
            await h.put(f"/q{i}.bin", pattern(f"q{i}", 64 * 1024))
        assert remote.queue_length() == 3 and remote.stats.uploads_dropped == 2
        for i in range(5):   # local reads are unaffected
            assert await h.get(f"/q{i}.bin") == pattern(f"q{i}", 64 * 1024)
        with pytest.raises(FsError) as e:
            await h.store.find(ROOT_INO, b"elsewhere.bin")
        assert e.value.errno == errno.ENOENT and remote.stats.skipped_down == 1
        status = remote.status()
        assert status["reachable"] is False and status["queue"] == 3 and status["dropped"] == 2


def test_capacity_is_bounded_by_size_and_by_age(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket, max_bytes="3MiB")
    s3 = ceph.s3_client()

    @serving(h)
    async def _():
        for i in range(6):
            await h.put(f"/c{i}.bin", pattern(f"c{i}", MiB))
        await until(lambda: remote.stats.uploads == 6, "six uploads")
        done = await remote.enforce_capacity()
        listed = s3.list_objects_v2(Bucket=bucket[0]).get("Contents", [])
        total = sum(o["Size"] for o in listed)
        assert total <= 0.9 * 3 * MiB and done["deleted"] == 6 - len(listed) >= 3
        assert remote.stats.capacity_deletes == done["deleted"]
        # local copies are not touched by remote capacity
        for i in range(6):
            assert await h.get(f"/c{i}.bin") == pattern(f"c{i}", MiB)
        remote.policy.max_bytes, remote.policy.max_age = 0, 1.0
        await trio.sleep(2.1)    # S3 times are whole seconds
        done = await remote.enforce_capacity()
        assert done["deleted"] == len(listed) and done["objects"] == 0
        assert "Contents" not in s3.list_objects_v2(Bucket=bucket[0])


def test_unlink_deletes_the_remote_copy_and_eviction_does_not(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket)
    s3 = ceph.s3_client()

    def keys():
        return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket[0]).get("Contents", []))

    @serving(h)
    async def _():
        await h.put("/keep.bin", pattern("k", MiB))
        await h.put("/drop.bin", pattern("d", MiB))
        await until(lambda: remote.stats.uploads == 2, "two uploads")
        h.store.evict("/keep.bin")
        h.store.unlink(ROOT_INO, b"drop.bin")
        await until(lambda: keys() == ["keep.bin"], "the unlink to reach S3")
        with pytest.raises(FsError):   # the negative cache covers the delete's delay
            await h.store.find(ROOT_INO, b"drop.bin")
        await find_path(h, "/keep.bin")  # evicted here, still there
        assert await h.get("/keep.bin") == pattern("k", MiB)


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_read_of_an_object_changed_on_another_host_since_the_lookup_is_estale(
        harness, ceph, bucket, change):
    """B looked a block up, then A replaced or deleted it in the bucket: B's read gets
    ESTALE (the bytes its file named are nowhere now), never the other version's bytes,
    and B's next lookup finds what the name holds now."""
    a, b = harness(), harness()
    # prefetch 0: B's lookup fetches nothing (a prefetch would have the old bytes already)
    ra, _ = attach(a, ceph, bucket), attach(b, ceph, bucket, prefetch=0)
    old, new = pattern("old", 3 * MiB), pattern("new", 3 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/x.bin", old)
        await until(lambda: ra.stats.uploads == 1, "the upload")
        node = await find_path(b, "/x.bin")
        assert b.store.tier_of(node) == "remote"
        if change == "replaced":
            await a.put("/x.bin", new)
            await until(lambda: ra.stats.uploads == 2, "the new version's upload")
        else:
            a.store.unlink(ROOT_INO, b"x.bin")
            s3 = ceph.s3_client()
            await until(lambda: "Contents" not in s3.list_objects_v2(Bucket=bucket[0]),
                        "the delete to reach S3")
        handle = await b.store.open(node.ino, os.O_RDONLY)
        with pytest.raises(FsError) as e:
            await b.read(handle.fh, 0, len(old))
        assert e.value.errno == errno.ESTALE, e.value
        b.store.release(handle.fh)
        if change == "replaced":
            await find_path(b, "/x.bin")
            assert await b.get("/x.bin") == new
        else:
            with pytest.raises(FsError) as e:
                await b.store.find(ROOT_INO, b"x.bin")
            assert e.value.errno == errno.ENOENT
    a.check_consistency()
    b.check_consistency()


def test_symlinks_and_special_files_stay_local(harness, ceph, bucket):
    """The remote tier carries files: a symlink or FIFO is neither uploaded nor found by
    another host, and one that takes an uploaded file's name by rename deletes its copy
    (no upload would replace it). Found locally, they cost no remote lookup."""
    a, b = harness(), harness()
    ra = attach(a, ceph, bucket)
    attach(b, ceph, bucket)
    s3 = ceph.s3_client()

    def keys():
        return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket[0]).get("Contents", []))

    @serving(a, b)
    async def _():
        await a.put("/d/x.bin", pattern("x", MiB))
        await a.put("/d/y.bin", pattern("y", MiB))
        await until(lambda: ra.stats.uploads == 2, "two uploads")
        d = a.store.ns.resolve("/d").ino
        a.store.symlink(d, b"link", b"x.bin", 0, 0)
        a.store.mknod(d, b"fifo", stat.S_IFIFO | 0o644, 0, 0, 0)
        a.store.symlink(d, b"over", b"x.bin", 0, 0)
        a.store.rename(d, b"over", d, b"y.bin")
        await until(lambda: keys() == ["d/x.bin"], "y.bin's remote copy to go")
        assert ra.queue_length() == 0 and ra.stats.uploads == 2
        lookups = ra.stats.lookups
        for name in (b"link", b"fifo", b"y.bin"):
            assert (await a.store.find(d, name)).is_meta
        assert ra.stats.lookups == lookups
        await find_path(b, "/d/x.bin")   # the file, from S3
        bd = b.store.ns.resolve("/d").ino
        for name in (b"link", b"fifo", b"y.bin"):
            with pytest.raises(FsError) as e:
                await b.store.find(bd, name)
            assert e.value.errno == errno.ENOENT


@pytest.mark.parametrize("odd", [b"ctl\x01chars", b"line\nbreak", b"del\x7f", b"long"])
def test_a_path_that_can_be_no_s3_key_stays_local_and_costs_no_request(harness, ceph, bucket,
                                                                       odd):
    """Such a path has no key (S3 advises against control characters; a key stops at 1024
    bytes): the file is not uploaded, and a lookup in it is a miss without a request. A LIST
    of a prefix with control characters got HTTP 500 from radosgw at every lookup (stress-ng's
    filename stressor on a mount with the remote tier), each logged with the raw bytes."""
    h = harness()
    remote = attach(h, ceph, bucket)
    s3 = ceph.s3_client()

    @serving(h)
    async def _():
        await h.put("/d/plain.bin", pattern("plain", 4096))
        parent = h.store.ns.resolve("/d").ino
        if odd == b"long":   # five levels of 250-byte names: past 1024 bytes of key
            for level in range(5):
                parent = h.store.mkdir(parent, bytes([97 + level]) * 250, 0o755, 0, 0).ino
            name = b"x.bin"
        else:
            name = odd + b".bin"
        path = h.store.ns.path_of(h.store.ns.inodes[parent]).decode() + "/" + name.decode()
        await h.put(path, pattern("odd", 4096))
        await until(lambda: remote.stats.uploads >= 1, "the upload of plain.bin")
        await h.settle()
        await trio.sleep(0.5)   # an upload of the other one would have been queued with it
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket[0]).get("Contents", [])]
        assert keys == ["d/plain.bin"] and remote.queue_length() == 0
        lookups = remote.stats.lookups
        with pytest.raises(FsError) as e:
            await h.store.find(parent, odd + b"-other.bin")
        assert e.value.errno == errno.ENOENT
        assert remote.stats.lookups == lookups   # no request was made for it


def test_a_lookup_of_a_writers_temporary_asks_s3_nothing(harness, ceph, bucket):
    """The kernel looks a name up before it creates it, so every store looked its temporary
    (`<block>_<tag>.tmp`, never uploaded) up in S3 too: one S3 round trip per store."""
    h = harness()
    remote = attach(h, ceph, bucket)

    @serving(h)
    async def _():
        await h.put("/d/a.bin", pattern("a", 4096))
        parent = h.store.ns.resolve("/d").ino
        lookups = remote.stats.lookups
        for name in (b"b.bin_w0.tmp", b"c.bin.1234.tmp"):
            with pytest.raises(FsError) as e:
                await h.store.find(parent, name)
            assert e.value.errno == errno.ENOENT
        assert remote.stats.lookups == lookups
        with pytest.raises(FsError):
            await h.store.find(parent, b"b.bin")   # a block's own name is still asked for
        assert remote.stats.lookups == lookups + 1


def test_a_file_with_hard_links_stays_local(harness, ceph, bucket):
    """A key is a path, so a file with several names is not uploaded: the copy it had goes
    with its second name (a placeholder is fetched first), a write to it is not uploaded,
    and a name it takes by rename loses its remote copy."""
    a, b = harness(), harness()
    ra, rb = attach(a, ceph, bucket), attach(b, ceph, bucket)
    s3 = ceph.s3_client()

    def keys():
        return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket[0]).get("Contents", []))

    @serving(a, b)
    async def _():
        for name in ("x", "y", "z"):
            await a.put(f"/{name}.bin", pattern(name, MiB))
        await until(lambda: ra.stats.uploads == 3, "three uploads")
        x = a.store.ns.resolve("/x.bin")
        await a.store.link(x.ino, ROOT_INO, b"x2.bin")
        await until(lambda: keys() == ["y.bin", "z.bin"], "x.bin's copy to go")
        assert "remote" not in a.store.tier_of(x)
        handle = await a.store.open(x.ino, os.O_WRONLY)
        await a.write(handle.fh, 0, b"new")
        a.store.release(handle.fh)                  # not admitted: no upload follows
        assert ra.queue_length() == 0
        a.store.rename(ROOT_INO, b"x2.bin", ROOT_INO, b"y.bin")
        await until(lambda: keys() == ["z.bin"], "y.bin's copy to go")
        # on another host, a placeholder is fetched before it gets a second name
        z = await find_path(b, "/z.bin")
        assert b.store.tier_of(z) == "remote"
        await b.store.link(z.ino, ROOT_INO, b"z2.bin")
        await until(lambda: keys() == [], "z.bin's copy to go")
        assert await b.get("/z2.bin") == pattern("z", MiB)
        assert rb.stats.fetches == 1 and ra.stats.uploads == 3


def test_restart_keeps_the_uploaded_mark(harness, ceph, bucket):
    h = harness()
    remote = attach(h, ceph, bucket)

    @serving(h)
    async def _():
        await h.put("/a.bin", pattern("a", MiB))
        await until(lambda: remote.stats.uploads == 1, "the upload")
        await until(lambda: h.store.tiers.dirty_bytes == 0, "write-behind")

    h.reopen(clean=False)   # SIGKILL: the journal alone says what is uploaded
    remote = attach(h, ceph, bucket)

    @serving(h)
    async def _():
        node = h.store.ns.resolve("/a.bin")
        assert h.store.tier_of(node) == "nvme+remote"
        assert remote.queue_length() == 0
        await h.put("/b.bin", pattern("b", MiB))
        await until(lambda: remote.stats.uploads == 1, "the new file's upload")

    h.reopen(clean=True)    # snapshot path
    remote = attach(h, ceph, bucket)

    @serving(h)
    async def _():
        for name in ("/a.bin", "/b.bin"):
            assert h.store.tier_of(h.store.ns.resolve(name)) == "nvme+remote"
        assert remote.queue_length() == 0


def test_credentials_file_readable_by_others_is_refused(tmp_path):
    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    os.chmod(creds, 0o640)
    cfg = config.load_config(None, {"remote.enabled": True, "remote.bucket": "bkt",
                                    "remote.credentials_file": str(creds)})
    with pytest.raises(StartupError, match=r"readable or writable by group or others "
                                           r"\(mode 0640\): chmod 600 it"):
        open_bucket(cfg.remote)
    os.chmod(creds, 0o600)
    creds.write_text("[default]\naws_access_key_id = a\n")
    with pytest.raises(StartupError, match="lacks aws_secret_access_key"):
        open_bucket(cfg.remote)


def test_remote_section_is_checked(tmp_path):
    with pytest.raises(config.ConfigError, match="remote.bucket: expected a bucket name"):
        config.load_config(None, {"remote.enabled": True})
    with pytest.raises(config.ConfigError, match="remote.endpoint: expected"):
        config.load_config(None, {"remote.endpoint": "ftp://x"})
    with pytest.raises(config.ConfigError, match="remote.admission: expected one of"):
        config.load_config(None, {"remote.admission": "sometimes"})
    assert config.load_config(None).remote.enabled is False


def test_lookups_prefetch_in_order_within_the_byte_bound(harness, ceph, bucket):
    a, b = harness(), harness(dram=64 * MiB)
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=2, prefetch_max_bytes="8MiB")
    blocks = {f"/p/{i}.bin": pattern(f"p{i}", 3 * MiB + i) for i in range(6)}

    @serving(a, b)
    async def _():
        for path, data in blocks.items():
            await a.put(path, data)
        await until(lambda: a.store.remote.stats.uploads == 6, "the uploads")
        nodes = [await find_path(b, path) for path in blocks]   # a connector's prefix check
        # the bound (8 MiB) holds two 3 MiB blocks: the first two in lookup order, no more
        await until(lambda: rb.stats.prefetches == 2 and rb.fetcher.unread_bytes() == 6 * MiB + 1,
                    "two prefetches")
        for _ in range(20):
            await trio.sleep(0.05)
            assert rb.stats.prefetches == 2 and rb.fetcher.unread_bytes() <= 8 * MiB
        assert [b.store.tier_of(n).startswith("dram+") for n in nodes] == [True] * 2 + [False] * 4
        # reading frees the bound: each read lets the next block be prefetched
        for i, (path, data) in enumerate(blocks.items()):
            assert await b.get(path) == data
            await until(lambda i=i: rb.stats.prefetches == min(6, i + 3), f"prefetch {i + 3}")
        assert rb.stats.fetches == 6 and rb.stats.prefetches_read == 6
        assert rb.stats.fetch_failures == 0 and rb.fetcher.unread_bytes() == 0
    a.check_consistency()
    b.check_consistency()


def test_a_prefetch_is_dropped_when_dram_cannot_be_freed_at_once(harness, ceph, bucket):
    a, b = harness(), harness(dram=16 * MiB, nvme=0)
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=1)
    data = pattern("later", 6 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/later.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        for i in range(3):   # DRAM-only B: 12 MiB nothing else holds, which a prefetch keeps
            await b.put(f"/local{i}.bin", pattern(f"l{i}", 4 * MiB))
        await find_path(b, "/later.bin")
        await until(lambda: rb.stats.prefetches_dropped == 1, "the dropped prefetch")
        assert rb.stats.prefetches == 0
        for i in range(3):
            assert await b.get(f"/local{i}.bin") == pattern(f"l{i}", 4 * MiB)
        # the read fetches it itself (a read may evict, as any fetch does)
        assert await b.get("/later.bin") == data
        assert rb.stats.fetches == 1 and rb.stats.prefetches == 0


def test_corruption_found_by_a_prefetch_is_never_served(harness, ceph, bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=2)
    good = {name: pattern(name, 5 * MiB) for name in ("x", "y")}
    s3 = ceph.s3_client()

    @serving(a, b)
    async def _():
        for name, data in good.items():
            await a.put(f"/{name}.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 2, "the uploads")
        meta = s3.head_object(Bucket=bucket[0], Key="x.bin")["Metadata"]
        bad = bytearray(good["x"])
        bad[3 * MiB + 1] ^= 0x01      # same size, same checksum metadata
        s3.put_object(Bucket=bucket[0], Key="x.bin", Body=bytes(bad), Metadata=meta)
        node = await find_path(b, "/x.bin")
        handle = await b.store.open(node.ino, os.O_RDONLY)   # opened before the prefetch ran
        await find_path(b, "/y.bin")
        await until(lambda: rb.stats.checksum_failures == 1 and rb.stats.prefetches == 2
                    and rb.stats.fetch_failures == 1, "the prefetches")
        with pytest.raises(FsError) as e:
            await b.read(handle.fh, 0, node.size)
        assert e.value.errno == errno.EIO
        b.store.release(handle.fh)
        with pytest.raises(FsError) as e:   # removed here and deleted there: a miss
            await find_path(b, "/x.bin")
        assert e.value.errno == errno.ENOENT
        assert "Contents" not in s3.list_objects_v2(Bucket=bucket[0], Prefix="x.bin")
        assert await b.get("/y.bin") == good["y"]   # the good one was verified and served
        assert rb.stats.fetches == 1 and rb.stats.fetch_failures == 2   # prefetch and read
    b.check_consistency()


def test_remote_down_during_a_prefetch_leaves_a_miss_and_local_reads_go_on(harness, ceph,
                                                                           bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=1, timeout="1s", retry_interval="1h")
    data = pattern("far", 20 * MiB)   # more than the lookup's own GET asks for (16 MiB here)
    local = pattern("near", 2 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/far.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        await b.put("/near.bin", local)
        node = await find_path(b, "/far.bin")
        # the endpoint goes away between the lookup (whose GET brings the first 16 MiB) and
        # the rest of the prefetch: connections are refused
        rb.s3.client = make_client(dead_endpoint(), "us-east-1", load_credentials(bucket[1]),
                                   None, True, "path", 1, 4)
        await until(lambda: rb.stats.fetch_failures == 1, "the failed prefetch")
        assert not rb.reachable and rb.stats.fetches == 0
        assert node.parent is None          # the placeholder is gone: no bytes behind it
        with pytest.raises(FsError) as e:   # and the tier is down: lookups miss at once
            await find_path(b, "/far.bin")
        assert e.value.errno == errno.ENOENT
        assert await b.get("/near.bin") == local


def test_directory_levels_a_listing_showed_need_no_request(harness, ceph, bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)
    data = pattern("deep", 70000)

    @serving(a, b)
    async def _():
        await a.put("/m/r0/abc/de_g0/f.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        # m: HEAD and LIST together; the LIST shows m/r0/abc/de_g0/f.bin, so r0, abc and
        # de_g0 are directories without a request, and f.bin a file (its HEAD gives the size)
        node = await find_path(b, "/m/r0/abc/de_g0/f.bin")
        assert rb.stats.listed_hits == 3 and rb.stats.hits == 5 and node.size == len(data)
        assert b.store.ns.resolve("/m/r0/abc").is_dir
        assert await b.get("/m/r0/abc/de_g0/f.bin") == data
        with pytest.raises(FsError) as e:   # a name no listing showed is still asked for
            await find_path(b, "/m/r0/other")
        assert e.value.errno == errno.ENOENT and rb.stats.misses == 1


def test_a_read_is_served_each_chunk_once_checked_while_the_rest_still_arrives(harness, ceph,
                                                                              bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)
    data = pattern("streamed", 6 * MiB + 999)
    gate = hold_fetch_after_chunk(rb, 1)

    @serving(a, b)
    async def _():
        await a.put("/s.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        head = ceph.s3_client().head_object(Bucket=bucket[0], Key="s.bin")
        assert CHUNKS_META in head["Metadata"]   # what lets B check chunk by chunk
        node = await find_path(b, "/s.bin")
        handle = await b.store.open(node.ino, os.O_RDONLY)
        try:
            with trio.fail_after(20):   # a read waiting for the whole object would hang here
                assert await b.read(handle.fh, 0, 2 * MiB) == data[:2 * MiB]
            assert node.obj.arrival is not None and rb.stats.fetches == 0
            gate.set()
            assert await b.read(handle.fh, 2 * MiB, len(data)) == data[2 * MiB:]
        finally:
            gate.set()
            b.store.release(handle.fh)
        assert rb.stats.fetches == 1 and node.obj.arrival is None   # read to the end: whole
        assert await b.get("/s.bin") == data
    a.check_consistency()
    b.check_consistency()


def test_a_chunk_failing_its_checksum_after_others_were_served_is_never_served(harness, ceph,
                                                                              bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)
    data = pattern("partly bad", 5 * MiB)
    s3 = ceph.s3_client()
    gate = hold_fetch_after_chunk(rb, 0)

    @serving(a, b)
    async def _():
        await a.put("/p.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        meta = s3.head_object(Bucket=bucket[0], Key="p.bin")["Metadata"]
        bad = bytearray(data)
        bad[3 * MiB + 5] ^= 1    # chunk 3 no longer matches its CRC
        s3.put_object(Bucket=bucket[0], Key="p.bin", Body=bytes(bad), Metadata=meta)
        node = await find_path(b, "/p.bin")
        handle = await b.store.open(node.ino, os.O_RDONLY)
        try:
            with trio.fail_after(20):
                assert await b.read(handle.fh, 0, MiB) == data[:MiB]
            gate.set()
            with pytest.raises(FsError) as e:
                await b.read(handle.fh, MiB, 4 * MiB)
            assert e.value.errno == errno.EIO
        finally:
            gate.set()
            b.store.release(handle.fh)
        assert rb.stats.checksum_failures == 1 and rb.stats.fetches == 0
        with pytest.raises(FsError):
            b.store.ns.resolve("/p.bin")
    a.check_consistency()
    b.check_consistency()   # the failed fetch's chunks went back to the pool exactly once


def test_objects_without_chunk_checksums_are_checked_whole(harness, ceph, bucket):
    b = harness()
    rb = attach(b, ceph, bucket, prefetch=0)
    s3 = ceph.s3_client()
    data = pattern("older writer", 3 * MiB + 17)
    meta = {CRC_META: f"{crc32c.crc32c(data):08x}", SIZE_META: str(len(data))}

    @serving(b)
    async def _():
        # as written by a bluecache without chunk checksums, and with chunk checksums that
        # disagree with the object's own (both fall back to checking the object whole)
        s3.put_object(Bucket=bucket[0], Key="whole.bin", Body=data, Metadata=meta)
        s3.put_object(Bucket=bucket[0], Key="odd.bin", Body=data,
                      Metadata={**meta, CHUNKS_META: f"{MiB}:AAAAAAAAAAAAAAAAAAAAAA=="})
        for name in ("whole.bin", "odd.bin"):
            await find_path(b, f"/{name}")
            assert await b.get(f"/{name}") == data
        assert rb.stats.fetches == 2 and rb.stats.checksum_failures == 0
        bad = bytearray(data)
        bad[-1] ^= 1
        s3.put_object(Bucket=bucket[0], Key="bad.bin", Body=bytes(bad), Metadata=meta)
        await find_path(b, "/bad.bin")
        with pytest.raises(FsError) as e:
            await b.get("/bad.bin")
        assert e.value.errno == errno.EIO and rb.stats.checksum_failures == 1
    b.check_consistency()


def test_a_lookup_with_a_prefetch_slot_free_gets_the_first_bytes_instead_of_a_head(harness, ceph,
                                                                                  bucket):
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=1)
    files = {"/d/big.bin": pattern("big", 20 * MiB + 3), "/d/small.bin": pattern("small", 999),
             "/d/empty.bin": b"", "/d/sub/leaf.bin": pattern("leaf", 5000)}

    @serving(a, b)
    async def _():
        for path, data in files.items():
            await a.put(path, data)
        await until(lambda: a.store.remote.stats.uploads == len(files), "the uploads")
        await find_path(b, "/d")                     # (a GET that misses, and a LIST)
        opening = rb.stats.opening_gets
        big = await find_path(b, "/d/big.bin")      # a GET of 16 MiB answers the lookup
        assert rb.stats.opening_gets == opening + 1 and big.size == len(files["/d/big.bin"])
        small = await find_path(b, "/d/small.bin")  # the slot is busy: a HEAD, and queued
        assert rb.stats.opening_gets == opening + 1 and small.size == 999
        assert await b.get("/d/big.bin") == files["/d/big.bin"]
        await until(lambda: rb.stats.prefetches == 2, "the queued prefetch")
        assert await b.get("/d/small.bin") == files["/d/small.bin"]
        assert rb.stats.prefetches_read == 2
        # an empty object has no first byte to GET (416): the lookup falls back to a HEAD
        empty = await find_path(b, "/d/empty.bin")
        assert empty.size == 0 and await b.get("/d/empty.bin") == b""
        # /d holds files: a directory there is found by a LIST after the GET misses
        assert await find_path(b, "/d/sub/leaf.bin")
        assert await b.get("/d/sub/leaf.bin") == files["/d/sub/leaf.bin"]
        with pytest.raises(FsError) as e:
            await find_path(b, "/d/none.bin")
        assert e.value.errno == errno.ENOENT
        fetcher = rb.fetcher   # every slot came back
        assert fetcher._prefetching == 0 and fetcher._prefetching_bytes == 0
    a.check_consistency()
    b.check_consistency()


@pytest.mark.parametrize("sign", [False, True])
def test_uploads_sign_their_payload_only_when_asked(harness, ceph, bucket, sign):
    a, b = harness(), harness()
    ra = attach(a, ceph, bucket, sign_payload=sign, multipart_threshold="5MiB",
                part_size="5MiB")
    attach(b, ceph, bucket)
    seen = []
    ra.s3.client.meta.events.register(
        "before-send.s3", lambda request, **_: seen.append(
            (request.method, request.headers.get("x-amz-content-sha256"))))
    small, big = pattern("small", 3000), pattern("big", 11 * MiB)

    @serving(a, b)
    async def _():
        await a.put("/small.bin", small)     # one PUT
        await a.put("/big.bin", big)         # a multipart upload
        await until(lambda: ra.stats.uploads == 2, "the uploads")
        await find_path(b, "/small.bin")
        await find_path(b, "/big.bin")
        assert await b.get("/small.bin") == small and await b.get("/big.bin") == big
    bodies = [h.decode() if isinstance(h, bytes) else h for m, h in seen if m == "PUT"]
    assert len(bodies) == 4   # the small PUT and three parts
    if sign:
        assert all(len(h) == 64 and h != "UNSIGNED-PAYLOAD" for h in bodies), bodies
    else:
        assert set(bodies) == {"UNSIGNED-PAYLOAD"}


def test_fetches_hand_their_connection_back_to_the_pool(harness, ceph, bucket):
    # A fetch reads the socket under urllib3 itself (bluecached/tiers/s3.py, _direct_reader); a
    # connection not handed back would cost every GET a new TCP connection.
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)
    blocks = {f"/c{i}.bin": pattern(f"c{i}", 3 * MiB + i) for i in range(6)}

    @serving(a, b)
    async def _():
        for path, data in blocks.items():
            await a.put(path, data)
        await until(lambda: a.store.remote.stats.uploads == len(blocks), "the uploads")
        for path, data in blocks.items():
            await find_path(b, path)
            assert await b.get(path) == data
    pool = rb.s3.client._endpoint.http_session._manager.connection_from_url(ceph.endpoint)
    assert rb.stats.fetches == len(blocks)
    assert pool.num_requests >= 2 * len(blocks) and pool.num_connections <= 3, \
        (pool.num_requests, pool.num_connections)


def test_a_bug_in_one_fetch_fails_its_readers_not_the_daemon(harness, ceph, bucket, monkeypatch,
                                                             caplog):
    """A fetch is a task of the fetcher's nursery: an unexpected exception in it would end the
    daemon, with every object only DRAM holds. It fails that file's readers (EIO), is logged
    with its traceback, and the next read fetches the file."""
    a, b = harness(), harness()
    attach(a, ceph, bucket)
    rb = attach(b, ceph, bucket, prefetch=0)   # the read's own fetch
    data = pattern("bug", 3 * MiB)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    @serving(a, b)
    async def _():
        await a.put("/blk.bin", data)
        await until(lambda: a.store.remote.stats.uploads == 1, "the upload")
        await find_path(b, "/blk.bin")
        with monkeypatch.context() as patched:
            patched.setattr(rb.link.s3, "get_into", broken)
            with pytest.raises(FsError) as e:
                await b.get("/blk.bin")
        assert e.value.errno == errno.EIO
        assert await b.get("/blk.bin") == data
    assert any("fetch of inode" in r.getMessage() and r.exc_info for r in caplog.records)
    b.check_consistency()
