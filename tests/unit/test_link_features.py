"""hostd sends an optional argument (or op) only to a daemon whose hello lists it: a host
upgraded before its DPU must keep writing (an older daemon refuses unknown arguments)."""

import errno
import os

import pytest
import trio

from bluecached.wire.client import RemoteError
from hostd.link import DaemonLink


class RecordingClient:
    def __init__(self, features):
        self.features = features
        self.calls = []

    async def handshake(self, timeout=None, replaces=None):
        hello = {"engine": "loopback", "incarnation": "x", "session": 1, "server": "test"}
        if self.features is not None:
            hello["features"] = self.features
        return hello

    async def call(self, op, timeout=None, **args):
        self.calls.append((op, args))
        return {"failed": []}


def sent_args(features) -> dict:
    client = RecordingClient(features)
    link = DaemonLink(client, None, slots=2, request_timeout=5)

    async def main():
        await link.connect()
        fh = link._add_file(5, 0o1, daemon_fh=9, size=0)   # open for writing
        await link._write_slot(fh, 0, 0, 4096, True)   # a write that must clear set-ID bits

    trio.run(main, strict_exception_groups=True)
    return client.calls[-1][1]


def test_kill_suidgid_goes_only_to_a_daemon_that_knows_it():
    assert sent_args(["kill_suidgid"]).get("kill_suidgid") is True
    assert "kill_suidgid" not in sent_args(None)        # an older daemon: no features
    assert "kill_suidgid" not in sent_args([])


class BackingClient(RecordingClient):
    """Answers `backing` as bluecached's local client does: (fd, size), or RemoteError."""

    def __init__(self, features, answer):
        super().__init__(features)
        self.answer = answer

    async def backing(self, fh, timeout=None):
        self.calls.append(("backing", {"fh": fh}))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def backing_of(features, answer):
    client = BackingClient(features, answer)
    link = DaemonLink(client, None, slots=2, request_timeout=5)

    async def main():
        await link.connect()
        fh = link._add_file(5, os.O_RDONLY, daemon_fh=9, size=0)
        return await link.backing(fh)

    return trio.run(main, strict_exception_groups=True), client.calls


def test_backing_is_asked_only_of_a_daemon_that_has_it():
    assert backing_of(["backing"], (7, 100)) == ((7, 100), [("backing", {"fh": 9})])
    assert backing_of(None, (7, 100)) == (None, [])   # an older daemon: never asked
    assert backing_of(["kill_suidgid"], (7, 100)) == (None, [])


def test_enodata_means_no_backing_and_other_errors_fail():
    assert backing_of(["backing"], RemoteError(errno.ENODATA, "being written"))[0] is None
    with pytest.raises(RemoteError) as failed:
        backing_of(["backing"], RemoteError(errno.EIO, "daemon trouble"))
    assert failed.value.errno == errno.EIO


class OpeningClient(BackingClient):
    """Also answers an open that asks for the memfd, with none (an object only on NVMe)."""

    async def call_with_fd(self, op, timeout=None, **args):
        self.calls.append((op, args))
        attr = {"ino": 5, "mode": 0o100644, "nlink": 1, "uid": 0, "gid": 0, "size": 4096,
                "atime_ns": 0, "mtime_ns": 0, "ctime_ns": 0}
        return {"fh": 9, "attr": attr}, None


def test_an_open_that_brought_no_memfd_is_not_asked_about_again():
    """The passthrough asks backing() right after a read-only open: where the open asked
    for the memfd and got none, bluecached is not asked a second time."""
    client = OpeningClient(["backing", "open_backing"], (7, 100))
    link = DaemonLink(client, None, slots=2, request_timeout=5)
    link.wants_backing = lambda: True

    async def main():
        await link.connect()
        fh, _ = await link.open(5, os.O_RDONLY)
        return await link.backing(fh)

    assert trio.run(main, strict_exception_groups=True) is None
    assert [op for op, _ in client.calls] == ["open"]
    assert client.calls[0][1].get("backing") is True
