"""The write ops' kill_suidgid flag (hostd passes on the kernel's FUSE_WRITE_KILL_SUIDGID): the
daemon clears S_ISUID, and S_ISGID when group-executable, before the write; without the flag
(a writer holding CAP_FSETID) the bits stay."""

import os

from bluecached.namespace import ROOT_INO
from support import FileClient, MiB


def _file(fc, name: bytes, mode: int) -> dict:
    opened = fc.client.call("create", parent=ROOT_INO, name=name, mode=mode, uid=0, gid=0,
                            flags=os.O_RDWR)
    assert opened["attr"]["mode"] & 0o7777 == mode
    return opened


def _mode(fc, opened) -> int:
    return fc.client.call("getattr", ino=opened["attr"]["ino"])["mode"] & 0o7777


def test_write_with_kill_suidgid_clears_the_bits_and_without_keeps_them(daemon):
    d = daemon().start()
    fc = FileClient(d, region_size=MiB)
    fc.shm.view[:10] = b"0123456789"
    write = dict(offset=0, length=10, region=fc.region, region_offset=0)

    kept = _file(fc, b"kept", 0o6777)
    fc.client.call("write", fh=kept["fh"], **write)
    fc.client.call("write", fh=kept["fh"], kill_suidgid=False, **write)
    assert _mode(fc, kept) == 0o6777

    killed = _file(fc, b"killed", 0o6777)
    before = fc.client.call("getattr", ino=killed["attr"]["ino"])
    assert fc.client.call("write", fh=killed["fh"], kill_suidgid=True, **write)["length"] == 10
    after = fc.client.call("getattr", ino=killed["attr"]["ino"])
    assert after["mode"] & 0o7777 == 0o777 and after["ctime_ns"] >= before["ctime_ns"]
    assert fc.get("killed", step=MiB) == b"0123456789"

    locking = _file(fc, b"locking", 0o2767)   # S_ISGID without group execute: stays
    fc.client.call("write", fh=locking["fh"], kill_suidgid=True, **write)
    assert _mode(fc, locking) == 0o2767

    # write_batch: only the writes named in kill_suidgid clear
    a, b, c = (_file(fc, name, 0o4755) for name in (b"a", b"b", b"c"))
    r = fc.client.call("write_batch", region=fc.region, fhs=[a["fh"], b["fh"], c["fh"]],
                       offsets=[0, 0, 0], lengths=[10, 10, 10], region_offsets=[0, 0, 0],
                       kill_suidgid=[0, 2])
    assert r == {"length": 30, "failed": []}
    assert [_mode(fc, f) for f in (a, b, c)] == [0o755, 0o4755, 0o755]
    fc.close()


def test_the_cleared_mode_survives_a_restart(daemon):
    d = daemon().start()
    fc = FileClient(d, region_size=MiB)
    fc.put("/f", b"x" * 100)
    ino = fc.client.call("lookup", parent=ROOT_INO, name=b"f")["ino"]
    fc.client.call("setattr", ino=ino, mode=0o4777)
    opened = fc.client.call("open", ino=ino, flags=os.O_WRONLY)
    fc.shm.view[:1] = b"y"
    fc.client.call("write", fh=opened["fh"], offset=0, length=1, region=fc.region,
                   region_offset=0, kill_suidgid=True)
    fc.client.call("release", fh=opened["fh"])
    fc.close()
    d.stop()
    d.start()
    fc = FileClient(d, region_size=MiB)
    attr = fc.client.call("lookup", parent=ROOT_INO, name=b"f")
    assert attr["mode"] & 0o7777 == 0o777
    assert fc.get("/f", step=MiB) == b"y" + b"x" * 99
    fc.close()
