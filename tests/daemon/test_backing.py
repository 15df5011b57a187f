"""The `backing` op against a real bluecached: the file's memfd arrives over the local unix
socket (SCM_RIGHTS), read-only and byte-exact; over zmq the answer is always ENODATA."""

import errno
import os
import stat

import pytest
import trio

from bluecached.namespace import ROOT_INO
from bluecached.wire import protocol
from bluecached.wire.client import AsyncClient, RemoteError
from bluecached.wire.local_transport import LocalClient
from support import FileClient, MiB, pattern


async def _local_client(d, nursery) -> LocalClient:
    client = LocalClient(protocol.state_dir_endpoints(str(d.state_dir))["local"], "test")
    await nursery.start(client.run)
    with trio.fail_after(10):
        while True:
            try:
                await client.handshake(timeout=2)
                return client
            except RemoteError:
                await trio.sleep(0.05)


def test_the_memfd_arrives_over_the_local_socket_byte_exact(daemon):
    d = daemon().start()
    data = pattern("kv", 5 * MiB + 12345)   # a partial last chunk: the memfd ends mid-page
    files = FileClient(d)
    files.put("/blocks/a", data)

    async def main():
        async with trio.open_nursery() as nursery:
            client = await _local_client(d, nursery)
            assert "backing" in client.hello["features"]
            parent = (await client.call("lookup", parent=ROOT_INO, name=b"blocks"))["ino"]
            ino = (await client.call("lookup", parent=parent, name=b"a"))["ino"]
            fh = (await client.call("open", ino=ino, flags=os.O_RDONLY))["fh"]
            fd, size = await client.backing(fh)
            try:
                assert size == len(data) == os.fstat(fd).st_size
                assert stat.S_ISREG(os.fstat(fd).st_mode)
                assert os.pread(fd, len(data) + 4096, 0) == data
                assert os.get_inheritable(fd) is False
                with pytest.raises(OSError) as e:   # read-only: the reader cannot change it
                    os.pwrite(fd, b"x", 0)
                assert e.value.errno == errno.EBADF
            finally:
                os.close(fd)
            await client.call("release", fh=fh)

            # a write handle: no backing, and the handle itself stays good
            wfh = (await client.call("open", ino=ino, flags=os.O_RDWR))["fh"]
            with pytest.raises(RemoteError) as e:
                await client.backing(wfh)
            assert e.value.errno == errno.ENODATA
            assert (await client.call("getattr", ino=ino))["size"] == len(data)
            await client.call("release", fh=wfh)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    assert files.get("/blocks/a") == data
    files.close()


def test_a_read_only_open_brings_the_memfd_in_its_reply(daemon):
    """open(backing=True): one round trip per cache hit instead of open + backing. Where there
    is no memfd to give (a write open, a file open for writing), the open stands without one."""
    d = daemon().start()
    data = pattern("one-trip", 3 * MiB + 7)
    files = FileClient(d)
    files.put("/b", data)

    async def main():
        async with trio.open_nursery() as nursery:
            client = await _local_client(d, nursery)
            assert "open_backing" in client.hello["features"]
            ino = (await client.call("lookup", parent=ROOT_INO, name=b"b"))["ino"]
            r, fd = await client.call_with_fd("open", ino=ino, flags=os.O_RDONLY, backing=True)
            try:
                assert fd is not None and r["backing_size"] == len(data)
                assert os.pread(fd, len(data) + 1, 0) == data
            finally:
                os.close(fd)
            await client.call("release", fh=r["fh"])

            wr, wfd = await client.call_with_fd("open", ino=ino, flags=os.O_RDWR, backing=True)
            assert wfd is None and "backing_size" not in wr
            # open for writing by another handle: the read-only open gets no memfd either
            r2, fd2 = await client.call_with_fd("open", ino=ino, flags=os.O_RDONLY, backing=True)
            assert fd2 is None and "backing_size" not in r2
            for fh in (wr["fh"], r2["fh"]):
                await client.call("release", fh=fh)
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    # over zmq the open answers as always, without a memfd
    fh_reply = files.client.call("open", ino=files.client.call(
        "lookup", parent=ROOT_INO, name=b"b")["ino"], flags=os.O_RDONLY, backing=True)
    assert "backing_size" not in fh_reply
    files.client.call("release", fh=fh_reply["fh"])
    files.close()


def test_over_zmq_it_is_always_enodata(daemon):
    d = daemon().start()
    files = FileClient(d)
    files.put("/f", pattern("f", MiB))
    ino = files.client.call("lookup", parent=ROOT_INO, name=b"f")["ino"]
    fh = files.client.call("open", ino=ino, flags=os.O_RDONLY)["fh"]
    with pytest.raises(RemoteError) as e:   # the daemon's answer over the zmq socket
        files.client.call("backing", fh=fh)
    assert e.value.errno == errno.ENODATA
    files.client.call("release", fh=fh)

    async def main():   # the async zmq client answers so without asking
        client = AsyncClient(d.endpoints["control"], client_name="test")
        with pytest.raises(RemoteError) as e:
            await client.backing(1)
        assert e.value.errno == errno.ENODATA
        client._sock.close()

    trio.run(main)
    files.close()


def test_a_lookup_prepares_the_open_of_a_file_only_on_nvme(daemon):
    """lookup(prepare=True) from a client on this host: for a file only on NVMe read through
    the daemon (hit_path direct, as on this ext4), the reply says that the open after it lends
    nothing, so the client may answer that open itself (hostd/kept_backings.py). Not for a
    file in DRAM, nor without `prepare`, nor over zmq (no client there answers opens)."""
    d = daemon(allow_log=["lookup: argument 'prepare' must be bool",
                          "open: argument 'kept' must be u64[2]"]).start()
    files = FileClient(d)
    files.put("/cold", pattern("cold", 2 * MiB))
    files.close()
    d.stop()
    d.start()   # every file only on NVMe
    files = FileClient(d)
    files.put("/new", pattern("new", MiB))   # in DRAM

    async def main():
        async with trio.open_nursery() as nursery:
            client = await _local_client(d, nursery)
            assert "open_prepared" in client.hello["features"]
            r = await client.call("lookup", parent=ROOT_INO, name=b"cold", prepare=True)
            assert r["prepared"] == {"kind": "plain"}
            # the promise holds: an open asking for the memfd gets none
            opened, fd = await client.call_with_fd("open", ino=r["ino"], flags=os.O_RDONLY,
                                                   backing=True)
            assert fd is None and "backing_size" not in opened
            await client.call("release", fh=opened["fh"])
            assert "prepared" not in await client.call("lookup", parent=ROOT_INO, name=b"cold")
            assert "prepared" not in await client.call("lookup", parent=ROOT_INO, name=b"new",
                                                       prepare=True)
            with pytest.raises(RemoteError) as e:
                await client.call("lookup", parent=ROOT_INO, name=b"cold", prepare=1)
            assert e.value.errno == errno.EINVAL
            assert "prepared" not in files.client.call("lookup", parent=ROOT_INO, name=b"cold",
                                                       prepare=True)
            # a malformed `kept` fails the open and leaves no handle behind (this session's
            # would go only when it ends)
            with pytest.raises(RemoteError) as e:
                await client.call("open", ino=r["ino"], flags=os.O_RDONLY, kept=[1, 2, 3])
            assert e.value.errno == errno.EINVAL
            assert await client.call("evict", path="/cold") == {"removed": 1, "skipped_open": 0}
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    files.close()
