"""hostd's kept memfds (hostd/kept_backings.py): what is kept, for how long, and what lets an
entry go. Real memfds; the clock is the test's."""

import os
import resource

import pytest

from hostd.kept_backings import PREPARED_HOLD_S, PREPARED_LIMIT, KeptBackings


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def files():
    made = []

    def make(content: bytes = b"") -> int:
        fd = os.memfd_create("object")
        os.write(fd, content)
        made.append(fd)
        return fd

    yield make
    for fd in made:
        os.close(fd)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_all(fd: int) -> bytes:
    try:
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


def test_a_kept_memfd_answers_later_opens_with_its_bytes(files):
    kept = KeptBackings(limit=4, idle=60)
    fd = os.memfd_create("object")
    os.write(fd, b"block 1")
    kept.keep(1, fd, 7, attr="attr", generation=3, stamp=kept.stamp())
    os.close(fd)   # the handle that brought it is gone: the kept duplicate lives on
    got, entry = kept.take(1, generation=3)
    assert read_all(got) == b"block 1"
    assert (entry.size, entry.attr) == (7, "attr")
    assert kept.take(2, generation=3) is None
    assert kept.answered == 1


def test_a_memfd_of_another_daemon_generation_is_dropped(files):
    kept = KeptBackings(limit=4, idle=60)
    kept.keep(1, files(b"x"), 1, None, generation=3, stamp=kept.stamp())
    assert kept.take(1, generation=4) is None
    assert len(kept) == 0


def test_a_change_during_the_open_keeps_nothing(files):
    kept = KeptBackings(limit=4, idle=60)
    stamp = kept.stamp()          # a reader's open is sent ...
    kept.changing(1)              # ... a writer opens the file before its reply
    kept.keep(1, files(b"old"), 3, None, generation=1, stamp=stamp)
    assert kept.take(1, generation=1) is None


def test_changing_drops_the_entry(files):
    kept = KeptBackings(limit=4, idle=60)
    kept.keep(1, files(b"x"), 1, None, generation=1, stamp=kept.stamp())
    kept.changing(1)
    assert kept.take(1, generation=1) is None


def test_the_bound_lets_the_least_recently_opened_go(files):
    kept = KeptBackings(limit=2, idle=60)
    before = open_fds()
    for ino in (1, 2):
        kept.keep(ino, files(b"x"), 1, None, 1, kept.stamp())
    os.close(kept.take(1, 1)[0])        # 1 opened last: 2 is the oldest
    kept.keep(3, files(b"x"), 1, None, 1, kept.stamp())
    assert len(kept) == 2
    assert kept.take(2, 1) is None
    for ino in (1, 3):
        os.close(kept.take(ino, 1)[0])
    kept.clear()
    assert open_fds() == before + 3     # the test's own three memfds, no kept duplicate


def test_idle_entries_go(files):
    clock = Clock()
    kept = KeptBackings(limit=4, idle=10, clock=clock)
    kept.keep(1, files(b"x"), 1, None, 1, kept.stamp())
    clock.now += 5
    kept.keep(2, files(b"x"), 1, None, 1, kept.stamp())
    clock.now += 6
    kept.expire()
    assert len(kept) == 1 and kept.take(1, 1) is None
    clock.now += 11                      # unused past idle: not handed out even unexpired
    assert kept.take(2, 1) is None


def test_a_refusal_drops_only_the_memfd_it_was_about(files):
    kept = KeptBackings(limit=4, idle=60)
    kept.keep(1, files(b"old"), 3, None, 1, kept.stamp())
    old_identity = kept.take(1, 1)[1].identity
    kept.changing(1)
    kept.keep(1, files(b"new"), 3, None, 1, kept.stamp())
    kept.refused_by_daemon(1, old_identity)   # a late answer about the one before
    got, _ = kept.take(1, 1)
    assert read_all(got) == b"new"
    kept.refused_by_daemon(1, kept._kept[1].identity)
    assert kept.take(1, 1) is None and kept.refused == 1


def test_zero_keeps_nothing(files):
    kept = KeptBackings(limit=0, idle=60)
    kept.keep(1, files(b"x"), 1, None, 1, kept.stamp())
    assert len(kept) == 0


def test_out_of_fds_an_open_is_neither_kept_nor_failed(files, caplog):
    kept = KeptBackings(limit=4, idle=60)
    kept.keep(1, files(b"x"), 1, None, 1, kept.stamp())
    fd = files(b"y")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))   # every fd below it taken
    try:   # no fd to spare: nothing kept, and nothing handed out (bluecached answers)
        kept.keep(2, fd, 1, None, 1, kept.stamp())
        assert kept.take(1, 1) is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(kept) == 1 and kept.take(2, 1) is None
    os.close(kept.take(1, 1)[0])
    assert "kept opens: Too many open files" in caplog.text
    kept.clear()


# -- opens prepared at the lookup ------------------------------------------------------------

def test_a_prepared_open_answers_the_next_read_only_open_once():
    kept = KeptBackings(limit=4, idle=60)
    kept.prepare(1, {"kind": "plain"}, attr="attr", generation=2, stamp=kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY | os.O_DIRECT, generation=2).attr == "attr"
    assert kept.take_prepared(1, os.O_RDONLY, generation=2) is None   # once
    assert kept.answered_prepared == 1


def test_buffered_is_for_buffered_opens_only():
    """hit_path clone: an O_DIRECT open is to get a clone, which bluecached gives at the open."""
    kept = KeptBackings(limit=4, idle=60)
    kept.prepare(1, {"kind": "buffered"}, None, 1, kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY | os.O_DIRECT, 1) is None
    kept.prepare(1, {"kind": "buffered"}, None, 1, kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY, 1) is not None


@pytest.mark.parametrize("what", [{"kind": "clone"}, {}, {"kind": 3}])
def test_an_unknown_kind_prepares_nothing(what):
    kept = KeptBackings(limit=4, idle=60)
    kept.prepare(1, what, None, 1, kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY, 1) is None


def test_a_prepared_open_goes_with_a_change_a_restart_or_time():
    clock = Clock()
    kept = KeptBackings(limit=4, idle=60, clock=clock)
    stamp = kept.stamp()                 # a lookup is sent ...
    kept.changing(1)                     # ... a writer opens the file before its reply
    kept.prepare(1, {"kind": "plain"}, None, 1, stamp)
    assert kept.take_prepared(1, os.O_RDONLY, 1) is None
    kept.prepare(1, {"kind": "plain"}, None, 1, kept.stamp())
    kept.changing(1)                     # a writer after the lookup
    assert kept.take_prepared(1, os.O_RDONLY, 1) is None
    kept.prepare(1, {"kind": "plain"}, None, 1, kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY, generation=2) is None   # bluecached restarted
    kept.prepare(1, {"kind": "plain"}, None, 1, kept.stamp())
    clock.now += PREPARED_HOLD_S + 0.1   # an exists check's lookup, no open after it
    assert kept.take_prepared(1, os.O_RDONLY, 1) is None
    kept.prepare(2, {"kind": "plain"}, None, 1, kept.stamp())
    kept.clear()
    assert kept.take_prepared(2, os.O_RDONLY, 1) is None
    assert kept.answered_prepared == 0


def test_prepared_opens_are_bounded_and_expire():
    clock = Clock()
    kept = KeptBackings(limit=4, idle=60, clock=clock)
    for ino in range(PREPARED_LIMIT + 3):
        kept.prepare(ino, {"kind": "plain"}, None, 1, kept.stamp())
    assert len(kept._prepared) == PREPARED_LIMIT
    assert kept.take_prepared(0, os.O_RDONLY, 1) is None   # the oldest went first
    clock.now += PREPARED_HOLD_S + 0.1
    kept.expire()
    assert not kept._prepared


def test_kept_opens_off_prepares_nothing():
    kept = KeptBackings(limit=0, idle=60)
    kept.prepare(1, {"kind": "plain"}, None, 1, kept.stamp())
    assert kept.take_prepared(1, os.O_RDONLY, 1) is None
