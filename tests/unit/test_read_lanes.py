"""bluecached/tiers/read_lanes.py: an object's direct NVMe reads go to the disk one at a time,
lowest offset first; other objects' beside them, at most `depth` in all, the longest waiting
first; a failed read frees its lane."""

import threading
import time

import pytest

from bluecached.tiers.read_lanes import ReadLanes


def _wait_until(predicate, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_waiting_reads_go_lowest_offset_first_one_at_a_time():
    lanes = ReadLanes(depth=4)
    order, running, most = [], [0], [0]
    lock = threading.Lock()
    release_first = threading.Event()

    def read(offset: int, hold: threading.Event | None = None) -> None:
        with lanes.turn("obj", offset):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                order.append(offset)
            if hold is not None:
                assert hold.wait(10)
            with lock:
                running[0] -= 1

    first = threading.Thread(target=read, args=(8, release_first))
    first.start()
    _wait_until(lambda: order == [8], "the first read never ran")
    others = [threading.Thread(target=read, args=(offset,)) for offset in (3, 1, 2, 9)]
    for t in others:
        t.start()
    _wait_until(lambda: lanes.waiting("obj") == 4, "the other reads never queued")
    release_first.set()
    for t in [first, *others]:
        t.join(10)
    assert order == [8, 1, 2, 3, 9]
    assert most[0] == 1
    assert lanes.busy() == 0


def test_other_objects_do_not_wait_and_a_failed_read_frees_the_lane():
    lanes = ReadLanes(depth=2)
    inside_a = threading.Event()
    release_a = threading.Event()

    def hold_a() -> None:
        with lanes.turn("a", 0):
            inside_a.set()
            assert release_a.wait(10)

    t = threading.Thread(target=hold_a)
    t.start()
    try:
        assert inside_a.wait(10)
        with lanes.turn("b", 0):   # another object's read runs while a's holds its lane
            assert lanes.busy() == 2
    finally:
        release_a.set()
        t.join(10)
    with pytest.raises(OSError), lanes.turn("a", 0):
        raise OSError("disk")
    with lanes.turn("a", 4096):   # not left held by the failed one
        pass
    assert lanes.busy() == 0


def test_at_most_depth_reads_run_and_the_longest_waiting_object_goes_next():
    lanes = ReadLanes(depth=2)
    order, running, most = [], [0], [0]
    lock = threading.Lock()
    release = {key: threading.Event() for key in "abcd"}

    def read(key: str, offset: int) -> None:
        with lanes.turn(key, offset):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                order.append(key)
            assert release[key].wait(10)
            with lock:
                running[0] -= 1

    threads = []

    def start(key: str, offset: int = 0) -> None:
        threads.append(threading.Thread(target=read, args=(key, offset)))
        threads[-1].start()

    start("a")
    start("b")
    _wait_until(lambda: order == ["a", "b"], "the first two reads never ran")
    start("c")
    _wait_until(lambda: lanes.waiting("c") == 1, "c never queued")
    start("d")
    _wait_until(lambda: lanes.waiting("d") == 1, "d never queued")
    start("a", 4096)   # a's next piece came after c's and d's: they go first
    _wait_until(lambda: lanes.waiting("a") == 1, "a's second read never queued")
    release["b"].set()
    _wait_until(lambda: order[2:] == ["c"], "c did not go when b was done")
    release["a"].set()   # a's first is done: d waited longer than a's second
    _wait_until(lambda: order[3:] == ["d"], "d did not go next")
    release["c"].set()
    release["d"].set()
    for t in threads:
        t.join(10)
    assert order == ["a", "b", "c", "d", "a"] and most[0] == 2
    assert lanes.busy() == 0


def test_a_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ReadLanes(depth=0)
