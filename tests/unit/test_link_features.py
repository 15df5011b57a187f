"""hostd sends an optional argument only to a daemon whose hello lists it: a host upgraded
before its DPU must keep writing (an older daemon refuses unknown arguments)."""

import trio

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
