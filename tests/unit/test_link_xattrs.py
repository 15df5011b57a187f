"""hostd's extended-attribute calls: a daemon without the `xattrs` feature is never asked (an
older one would answer ENOSYS for an unknown op, which the kernel takes as "never again");
hostd answers EOPNOTSUPP itself. With the feature, the ops go as docs/protocol.md says."""

import errno

import pytest
import trio
from test_link_features import RecordingClient

from bluecached.wire.client import RemoteError
from hostd.link import DaemonLink


class XattrClient(RecordingClient):
    async def call(self, op, timeout=None, **args):
        self.calls.append((op, args))
        return {"getxattr": {"value": b"v"}, "listxattr": {"names": b"user.a\0user.b\0"}}.get(
            op, {})


def _run(features, fn):
    client = XattrClient(features)
    link = DaemonLink(client, None, slots=2, request_timeout=5)

    async def main():
        await link.connect()
        return await fn(link)

    return trio.run(main, strict_exception_groups=True), client.calls


@pytest.mark.parametrize("features", [None, [], ["kill_suidgid", "backing"]])
def test_a_daemon_without_the_feature_is_not_asked(features):
    for call in (lambda link: link.setxattr(7, b"user.a", b"v"),
                 lambda link: link.getxattr(7, b"user.a"),
                 lambda link: link.listxattr(7),
                 lambda link: link.removexattr(7, b"user.a")):
        with pytest.raises(RemoteError) as e:
            _run(features, call)
        assert e.value.errno == errno.EOPNOTSUPP


def test_the_ops_go_to_a_daemon_that_has_them():
    async def all_four(link):
        await link.setxattr(7, b"user.a", memoryview(b"value"))
        await link.setxattr(7, b"user.b", b"", 1)
        value = await link.getxattr(7, b"user.a")
        names = await link.listxattr(7)
        await link.removexattr(7, b"user.a")
        return value, names

    (value, names), calls = _run(["xattrs"], all_four)
    assert value == b"v" and names == [b"user.a", b"user.b"]
    assert calls == [("setxattr", {"ino": 7, "name": b"user.a", "value": b"value"}),
                     ("setxattr", {"ino": 7, "name": b"user.b", "value": b"", "flags": 1}),
                     ("getxattr", {"ino": 7, "name": b"user.a"}),
                     ("listxattr", {"ino": 7}),
                     ("removexattr", {"ino": 7, "name": b"user.a"})]
