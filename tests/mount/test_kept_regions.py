"""Zero-copy buffers kept registered between requests (hostd/region_cache.py): a reused buffer
is registered once, kept ones are bounded and released when idle, and a kept region never
outlives the daemon it was registered with (a restart registers again, byte-exact)."""

import time

import pytest

from hostd.zerocopy import SharedBuffer, load_into, store_from
from support import MiB, pattern, wait_settled

GONE = ["lost bluecached", "-> EIO", "not delivered"]


@pytest.fixture
def engine():
    """The loopback engine only: the doca engine exports each request's memory to the DPU
    itself, and keeps nothing."""
    return "loopback"


def regions(s) -> int:
    client = s.daemon.client()
    try:
        return client.call("stats")["regions"]
    finally:
        client.close()


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def round_trip(path: str, src: SharedBuffer, dst: SharedBuffer, data: bytes) -> None:
    assert store_from(path, src) == len(data)
    dst.view()[:] = bytes(len(data))
    assert load_into(path, dst) == len(data)
    assert dst.view() == data


def test_a_reused_buffer_is_registered_once_and_released_once_idle(mounted):
    s = mounted(hostd_settings={"zero_copy.region_idle": "1s"})
    before = regions(s)               # hostd's staging memory
    data = pattern("kept", 4 * MiB)
    with SharedBuffer(4 * MiB) as src, SharedBuffer(4 * MiB) as dst:
        src.view()[:] = data
        for i in range(4):
            round_trip(str(s.mnt / f"b{i}.bin"), src, dst, data)
            assert regions(s) == before + 2      # src and dst, each registered once
        # a part of a kept buffer at another offset uses the same registration
        part = dst.view()[MiB:2 * MiB]
        assert load_into(str(s.mnt / "b0.bin"), part, offset=3 * MiB) == MiB
        assert part == data[3 * MiB:4 * MiB]
        part.release()
        assert regions(s) == before + 2
    until(lambda: regions(s) == before, "idle buffers to be released")


def test_kept_buffers_are_bounded_and_zero_keeps_none(mounted):
    for kept in (1, 0):
        s = mounted(hostd_settings={"zero_copy.kept_regions": kept})
        before = regions(s)
        data = pattern(f"bound{kept}", MiB)
        buffers = [SharedBuffer(MiB) for _ in range(3)]
        try:
            for i, buf in enumerate(buffers * 2):
                buf.view()[:] = data
                assert store_from(str(s.mnt / f"f{i}.bin"), buf) == MiB
                assert regions(s) <= before + kept
            with open(s.mnt / "f5.bin", "rb") as f:
                assert f.read() == data
        finally:
            for buf in buffers:
                buf.close()


def test_a_kept_buffer_across_a_bluecached_restart_is_registered_again(mounted):
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "1GiB"})
    data, other = pattern("before", 4 * MiB), pattern("after", 4 * MiB)
    with SharedBuffer(4 * MiB) as buf:
        buf.view()[:] = data
        assert store_from(str(s.mnt / "a.bin"), buf) == 4 * MiB
        wait_settled(s.daemon)             # written behind: it survives the kill
        s.daemon.kill()
        s.daemon.start()                   # hostd reconnects by itself; its region is gone
        buf.view()[:] = bytes(4 * MiB)
        deadline = time.monotonic() + 30
        while True:                        # until hostd is through to the new daemon
            try:
                assert load_into(str(s.mnt / "a.bin"), buf) == 4 * MiB
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert buf.view() == data
        buf.view()[:] = other
        assert store_from(str(s.mnt / "b.bin"), buf) == 4 * MiB
    with open(s.mnt / "b.bin", "rb") as f:
        assert f.read() == other
    with open(s.mnt / "a.bin", "rb") as f:
        assert f.read() == data
