"""hostd/dir_attrs.py: a directory's attributes from the reply to this mount's change of it,
answered to the kernel's next GETATTR without bluecached, and only while they can be trusted."""

import os

import trio
import trio.testing

from hostd.dir_attrs import MAX_DIRS, DirAttrs
from hostd.link import DaemonLink


def _wire(ino: int, mtime: int = 1, mode: int = 0o40755) -> dict:
    return {"ino": ino, "mode": mode, "nlink": 2, "uid": 0, "gid": 0, "size": 0,
            "atime_ns": 0, "mtime_ns": mtime, "ctime_ns": mtime}


def _reply(seq: int, *dirs: dict) -> dict:
    return {"dir_attrs": {"seq": seq, "dirs": list(dirs)}}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_attributes_of_the_last_change_are_answered_until_they_are_too_old():
    clock = Clock()
    d = DirAttrs(trust_s=1.0, clock=clock)
    d.changed(_reply(1, _wire(7, mtime=10), _wire(8, mtime=10)))
    assert d.answer(7).mtime_ns == 10 and d.answer(8).mtime_ns == 10
    d.changed(_reply(3, _wire(7, mtime=30)))
    d.changed(_reply(2, _wire(7, mtime=20)))   # an earlier change's reply handled late
    assert d.answer(7).mtime_ns == 30
    clock.now += 1.5
    assert d.answer(7) is None and d.answer(8) is None
    assert d.answered == 3


def test_nothing_is_answered_or_taken_while_its_attributes_change():
    d = DirAttrs(clock=Clock())
    d.changed(_reply(1, _wire(7)))
    with d.changing(7):
        assert d.answer(7) is None
        d.changed(_reply(2, _wire(7, mtime=5)))   # a create in it, answered meanwhile
        assert d.answer(7) is None
    assert d.answer(7) is None   # the chmod's outcome is not known here: asked again


def test_replies_without_or_with_malformed_directory_attributes_change_nothing():
    d = DirAttrs(clock=Clock())
    for reply in ({}, {"dir_attrs": {"seq": 1}}, {"dir_attrs": {"seq": 1, "dirs": [{"ino": 7}]}},
                  {"dir_attrs": None}, {"dir_attrs": {"seq": 1, "dirs": 3}}):
        d.changed(reply)
    assert d.answer(7) is None


def test_the_oldest_go_first_past_the_bound():
    d = DirAttrs(clock=Clock())
    for ino in range(MAX_DIRS + 10):
        d.changed(_reply(ino + 1, _wire(ino)))
    assert d.answer(0) is None and d.answer(9) is None
    assert d.answer(10) is not None and d.answer(MAX_DIRS + 9) is not None


class DirClient:
    """A daemon whose changes reply with directory attributes; counts getattrs."""

    def __init__(self):
        self.calls = []
        self.seq = 0
        self.mode = 0o40755

    async def handshake(self, timeout=None, replaces=None):
        return {"engine": "loopback", "incarnation": "x", "session": 1, "server": "test",
                "features": ["dir_attrs"]}

    def fail_pending(self, errno_, why):
        pass

    async def call(self, op, timeout=None, **args):
        self.calls.append(op)
        self.seq += 1
        if op == "getattr":
            return _wire(args["ino"], mtime=self.seq, mode=self.mode)
        if op == "setattr":
            self.mode = 0o40000 | args["mode"]
            return _wire(args["ino"], mtime=self.seq, mode=self.mode)
        if op == "create":
            return {"fh": 1, "attr": _wire(50, mode=0o100644),
                    **_reply(self.seq, _wire(args["parent"], mtime=self.seq, mode=self.mode))}
        if op == "rename":
            return _reply(self.seq, _wire(args["parent"], mtime=self.seq, mode=self.mode),
                          _wire(args["new_parent"], mtime=self.seq))
        return {}


def _run(scenario) -> DirClient:
    client = DirClient()
    link = DaemonLink(client, None, slots=2, request_timeout=5)

    async def main():
        await link.connect()
        await scenario(link, client)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0),
             strict_exception_groups=True)
    return client


def test_a_getattr_after_a_create_and_a_rename_asks_nothing():
    async def scenario(link, client):
        await link.create(7, b"t.tmp", 0o644, 0, 0, os.O_WRONLY | os.O_CREAT)
        assert (await link.getattr(7)).mtime_ns == 1
        await link.rename(7, b"t.tmp", 8, b"t", 0)
        assert (await link.getattr(7)).mtime_ns == 2 and (await link.getattr(8)).mtime_ns == 2
        assert (await link.getattr(50)).ino == 50   # a file: asked

    assert _run(scenario).calls == ["create", "rename", "getattr"]


def test_a_chmod_of_a_directory_is_asked_for_not_answered_from_before_it():
    async def scenario(link, client):
        await link.create(7, b"t", 0o644, 0, 0, os.O_WRONLY | os.O_CREAT)
        await link.setattr(7, mode=0o700)
        assert (await link.getattr(7)).mode & 0o777 == 0o700

    assert _run(scenario).calls == ["create", "setattr", "getattr"]


def test_a_reconnect_forgets_them():
    async def scenario(link, client):
        await link.create(7, b"t", 0o644, 0, 0, os.O_WRONLY | os.O_CREAT)
        await link._establish()
        await link.getattr(7)

    assert _run(scenario).calls == ["create", "getattr"]
