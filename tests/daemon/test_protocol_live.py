"""The control socket under abuse and under load, and the CURVE-authenticated tcp transport."""

import errno
import os

import msgpack
import pytest
import trio
import zmq

from bluecached.namespace import ROOT_INO
from bluecached.wire import curve, protocol
from bluecached.wire.client import RemoteError, SyncClient, connect
from support import FileClient, MiB, free_port

BAD_FRAMES = [
    [b""], [b"\xc1"], [b"\x92\x01"],                     # empty, invalid, truncated array
    [msgpack.packb({"v": 1, "id": 5, "op": "nope"})],
    [msgpack.packb({"v": 1, "id": 6, "op": "getattr", "args": {"ino": "x"}})],
    [msgpack.packb({"v": 1, "id": 7, "op": "read", "args": {"fh": 1}})],
    [b"a", b"b", b"c"],                                  # too many frames
    [protocol.encode_request(8, "ping", {}) + b"\0" * 100_000],   # oversized
]


def test_malformed_messages_get_errors_and_the_daemon_keeps_serving(daemon):
    d = daemon(allow_log=["bad control message", "dropped a control message"]).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoints["control"])
    for frames in BAD_FRAMES:
        sock.send_multipart(frames)
    replies = []
    while sock.poll(1000):
        replies.append(protocol.decode_reply(sock.recv()))
    assert all(not r["ok"] for r in replies)
    by_id = {r["id"]: r["errno"] for r in replies if r["id"] is not None}
    assert by_id == {5: errno.ENOSYS, 6: errno.EINVAL, 7: errno.EINVAL}
    anonymous = sorted(r["errno"] for r in replies if r["id"] is None)
    assert anonymous == sorted([errno.EBADMSG] * 3 + [errno.EMSGSIZE])
    # not said hello yet on this socket:
    sock.send(protocol.encode_request(9, "getattr", {"ino": 1}))
    assert sock.poll(5000)
    reply = protocol.decode_reply(sock.recv())
    assert reply["errno"] == errno.EPROTO and "hello" in reply["error"]
    sock.close()
    client = d.client()
    assert client.call("getattr", ino=ROOT_INO)["ino"] == ROOT_INO
    assert client.call("stats")["bad_messages"] >= len(BAD_FRAMES) - 1
    client.close()
    assert d.proc.poll() is None


def test_a_flood_of_bad_messages_is_counted_not_logged_line_by_line(daemon):
    d = daemon(allow_log=["bad control message"]).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoints["control"])
    for _ in range(2000):
        sock.send(b"\xc1")
    answered = 0
    while answered < 2000 and sock.poll(5000):
        sock.recv()
        answered += 1
    sock.close()
    client = d.client()
    try:
        assert client.call("stats")["bad_messages"] == 2000
    finally:
        client.close()
    lines = [line for line in d.log_text().splitlines() if "bad control message" in line]
    assert len(lines) == 1, lines


def test_version_handshake_refuses_unknown_versions(daemon):
    d = daemon().start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoints["control"])
    sock.send(protocol.encode_request(1, "hello", {"versions": [7, 8]}))
    assert sock.poll(5000)
    reply = protocol.decode_reply(sock.recv())
    assert not reply["ok"] and reply["errno"] == errno.EPROTO and "[7, 8]" in reply["error"]
    sock.close()


def test_bad_region_requests_are_refused(daemon):
    d = daemon().start()
    fc = FileClient(d, region_size=MiB)
    opened = fc.client.call("create", parent=ROOT_INO, name=b"f", mode=0o644, uid=0, gid=0,
                            flags=os.O_RDWR)
    for region, offset, length, err in [(999, 0, 10, errno.EINVAL),
                                        (fc.region, MiB - 5, 10, errno.EFAULT),
                                        (fc.region, 1 << 63, 1, errno.EFAULT)]:
        with pytest.raises(RemoteError) as e:
            fc.client.call("write", fh=opened["fh"], offset=0, length=length, region=region,
                           region_offset=offset)
        assert e.value.errno == err
    assert fc.client.call("getattr", ino=opened["attr"]["ino"])["size"] == 0   # nothing stored
    with pytest.raises(RemoteError) as e:
        fc.client.call("read", fh=12345, offset=0, length=1, region=fc.region, region_offset=0)
    assert e.value.errno == errno.EBADF
    fc.close()


def test_write_batch_applies_in_order_and_answers_each_write_apart(daemon):
    d = daemon().start()
    fc = FileClient(d, region_size=MiB)
    a, b = (fc.client.call("create", parent=ROOT_INO, name=name, mode=0o644, uid=0, gid=0,
                           flags=os.O_RDWR) for name in (b"a", b"b"))
    fc.shm.view[:300] = b"1" * 100 + b"2" * 100 + b"3" * 100
    r = fc.client.call("write_batch", region=fc.region,
                       fhs=[a["fh"], 12345, b["fh"], a["fh"], b["fh"]],
                       offsets=[0, 0, 0, 50, 1 << 62],
                       lengths=[100, 100, 100, 100, 100],
                       region_offsets=[0, 100, 200, 100, MiB - 50])
    assert r["length"] == 300
    assert [(i, err) for i, err, _ in r["failed"]] == [(1, errno.EBADF), (4, errno.EFAULT)]
    assert fc.get("a", step=MiB) == b"1" * 50 + b"2" * 100   # the later write over the earlier
    assert fc.get("b", step=MiB) == b"3" * 100
    for lists in ({"fhs": [], "offsets": [], "lengths": [], "region_offsets": []},
                  {"fhs": [a["fh"]], "offsets": [0, 1], "lengths": [1], "region_offsets": [0]}):
        with pytest.raises(RemoteError) as e:
            fc.client.call("write_batch", region=fc.region, **lists)
        assert e.value.errno == errno.EINVAL
    fc.close()


def test_many_clients_with_many_outstanding_requests(daemon):
    d = daemon().start()
    endpoint = d.endpoints["control"]

    async def one_client(k: int):
        async with connect(endpoint, client_name=f"c{k}") as client:
            d_ino = (await client.call("mkdir", parent=ROOT_INO, name=f"c{k}".encode(),
                                       mode=0o755, uid=0, gid=0))["ino"]

            async def make(i):
                await client.call("mkdir", parent=d_ino, name=b"%d" % i, mode=0o755, uid=0,
                                  gid=0)

            async with trio.open_nursery() as nursery:   # 200 requests in flight at once
                for i in range(200):
                    nursery.start_soon(make, i)
            got = await client.call("readdir", ino=d_ino, offset=0, limit=4096)
            assert sorted(int(e[0]) for e in got["entries"]) == list(range(200))

    async def main():
        async with trio.open_nursery() as nursery:
            for k in range(8):
                nursery.start_soon(one_client, k)

    trio.run(main, strict_exception_groups=True)


def test_mkdir_races_give_exactly_one_winner(daemon):
    d = daemon().start()

    async def main():
        results = []
        async with connect(d.endpoints["control"]) as client:
            async def attempt():
                try:
                    await client.call("mkdir", parent=ROOT_INO, name=b"race", mode=0o777,
                                      uid=0, gid=0)
                    results.append("ok")
                except RemoteError as e:
                    results.append(e.errno)
            async with trio.open_nursery() as nursery:
                for _ in range(64):
                    nursery.start_soon(attempt)
        return results

    results = trio.run(main, strict_exception_groups=True)
    assert results.count("ok") == 1 and results.count(errno.EEXIST) == 63


def test_tcp_with_curve_admits_only_known_clients(daemon, tmp_path):
    keys = tmp_path / "curve"
    curve.generate(keys, "server")
    (keys / "clients").mkdir()
    pub, _ = curve.generate(keys, "host1")
    (keys / "clients" / "host1.key").write_bytes(pub.read_bytes())
    curve.generate(tmp_path / "other", "server")
    curve.generate(tmp_path / "other", "intruder")
    control = f"tcp://127.0.0.1:{free_port()}"
    d = daemon(allow_log=["refused a client"],
               **{"control.listen": control,
                  "control.events": f"tcp://127.0.0.1:{free_port()}",
                  "control.curve_dir": str(keys)}).start()
    client = SyncClient(control, curve.client_keys(keys, "host1"))
    assert client.call("getattr", ino=ROOT_INO)["ino"] == ROOT_INO
    client.close()
    intruder = curve.client_keys(tmp_path / "other", "intruder")
    intruder["server_public"] = curve.client_keys(keys, "host1")["server_public"]
    with pytest.raises(RemoteError) as e:
        SyncClient(control, intruder, timeout=1.5)
    assert e.value.errno == errno.ETIMEDOUT
    assert "refused a client whose CURVE public key" in d.log_text()   # the operator sees why
    with pytest.raises(RemoteError):    # no keys at all
        SyncClient(control, None, timeout=1.5)
    # a host's key added while the daemon runs lets it in without a restart
    pub2, _ = curve.generate(keys, "host2")
    (keys / "clients" / "host2.key").write_bytes(pub2.read_bytes())
    late = SyncClient(control, curve.client_keys(keys, "host2"))
    assert late.call("getattr", ino=ROOT_INO)["ino"] == ROOT_INO
    late.close()


def test_a_silent_client_loses_its_handles(daemon):
    d = daemon(**{"control.session_timeout": "1s"}).start()
    quiet = d.client()
    quiet.call("create", parent=ROOT_INO, name=b"held", mode=0o644, uid=0, gid=0,
               flags=os.O_WRONLY)
    watcher = d.client()
    assert watcher.call("stats")["open_handles"] == 1
    import time
    deadline = time.monotonic() + 10
    while watcher.call("stats")["open_handles"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert watcher.call("stats")["open_handles"] == 0
    with pytest.raises(RemoteError) as e:        # the silent client must say hello again
        quiet.call("ping")
    assert e.value.errno == errno.EPROTO
    quiet.close()
    watcher.close()


def test_a_full_forget_batch_is_answered(daemon):
    """hostd forwards FORGET in batches of protocol.MAX_FORGET: every batch must decode."""
    d = daemon(allow_log=["must be u64[]"]).start()
    client = d.client()
    n = protocol.MAX_FORGET
    assert client.call("forget", inos=list(range(2, n + 2)), counts=[1] * n) == {}
    with pytest.raises(RemoteError) as e:
        client.call("forget", inos=list(range(n + 1)), counts=[1] * (n + 1))
    assert e.value.errno == errno.EINVAL         # over the limit: refused, with an answer
    client.close()


def test_local_seqpacket_transport(daemon):
    """Embedded mode's fast path: same protocol, garbage refused, a disconnect releases what the
    client held at once (no waiting for the session timeout)."""
    import socket as pysocket
    d = daemon(allow_log=["bad control message"]).start()
    path = protocol.state_dir_endpoints(str(d.state_dir))["local"]
    assert (d.state_dir / "control.seq").stat().st_mode & 0o777 == 0o600
    sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_SEQPACKET)
    sock.connect(path)
    sock.settimeout(5)
    sock.send(b"\xc1garbage")
    assert protocol.decode_reply(sock.recv(65536))["errno"] == errno.EBADMSG
    sock.send(protocol.encode_request(1, "hello", {"versions": [1], "client": "raw"}))
    assert protocol.decode_reply(sock.recv(65536))["ok"]
    sock.send(protocol.encode_request(2, "create", {"parent": ROOT_INO, "name": b"f",
                                                    "mode": 0o644, "uid": 0, "gid": 0,
                                                    "flags": os.O_WRONLY}))
    assert protocol.decode_reply(sock.recv(65536))["ok"]
    watcher = d.client()
    assert watcher.call("stats")["open_handles"] == 1
    sock.close()
    import time
    deadline = time.monotonic() + 5
    while watcher.call("stats")["open_handles"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watcher.call("stats")["open_handles"] == 0
    watcher.close()


def test_a_local_client_that_leaves_replies_unread_does_not_take_the_daemon_down(daemon):
    # Closing a unix socket with unread data makes the other end's next recv fail with
    # ECONNRESET: a client that does that (a hostd killed or exiting mid-request) is gone,
    # nothing more.
    import socket as pysocket
    d = daemon().start()
    path = protocol.state_dir_endpoints(str(d.state_dir))["local"]
    for _ in range(3):
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_SEQPACKET)
        sock.connect(path)
        sock.send(protocol.encode_request(1, "hello", {"versions": [1], "client": "rude"}))
        for rid in range(2, 10):
            sock.send(protocol.encode_request(rid, "statfs", {}))
        sock.settimeout(5)
        sock.recv(65536, pysocket.MSG_PEEK)   # a reply is waiting, and stays unread
        sock.close()
    client = d.client()
    assert "files" in client.call("stats")
    client.close()
    assert d.proc.poll() is None


async def _handshake_when_up(client) -> None:
    with trio.fail_after(10):
        while True:
            try:
                await client.handshake(timeout=2)
                return
            except RemoteError:
                await trio.sleep(0.05)


def test_local_client_reconnects_to_a_restarted_daemon(daemon):
    from bluecached.wire.local_transport import LocalClient
    d = daemon().start()
    path = protocol.state_dir_endpoints(str(d.state_dir))["local"]

    async def main():
        client = LocalClient(path, "t")
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await _handshake_when_up(client)
            first = client.hello["incarnation"]
            await trio.to_thread.run_sync(d.stop)
            with pytest.raises(RemoteError):
                await client.call("ping", timeout=2)
            await trio.to_thread.run_sync(d.start)
            await _handshake_when_up(client)
            assert client.hello["incarnation"] != first
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)


def test_a_reconnect_after_a_restart_ends_only_its_own_old_session(daemon):
    # hostd reconnects naming its old session in `replaces`; after a restart that number must
    # not belong to somebody else (a bluecachectl that connected first lost its session).
    d = daemon().start()
    old = SyncClient(d.endpoints["control"], client_name="hostd")
    old_session = old.hello["session"]
    old.close()
    d.stop()
    d.start()
    ctl = SyncClient(d.endpoints["control"])
    try:
        back = SyncClient(d.endpoints["control"], client_name="hostd")
        back.call("hello", versions=list(protocol.SUPPORTED_VERSIONS), replaces=old_session)
        back.close()
        assert ctl.call("ping") == {}
    finally:
        ctl.close()
