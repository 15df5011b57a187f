"""A window of the DRAM tier may still be viewed when the tier lets it go: a download that
failed leaves its memoryviews of the destination chunks in the exception's traceback, which
trio's worker thread keeps until it next runs, and the fetch gives the content back at once.
Closing such a window must not raise (bluecached died of BufferError in map_ahead when a
probe's remote objects changed under their fetches); it is unmapped when the view goes."""

import ctypes
import gc

import pytest

from bluecached.tiers.dram import CHUNK_SIZE, DramPool, Memfd, populated_memfd


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def address_of(window) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(window))


@pytest.mark.parametrize("how", ["close", "resize"])
def test_a_window_mapped_ahead_and_still_viewed_is_let_go_without_an_error(how):
    memfd = populated_memfd(4)
    window = memfd.ahead[3]
    window[:5] = b"bytes"
    address = address_of(window)
    view = memoryview(window)[:5]   # what a failed download's traceback holds
    del window
    if how == "close":
        memfd.close()
        assert bytes(view) == b"bytes", "the viewer's mapping must stay readable"
    else:   # the windows past the new end go (touching them now would fault: past EOF)
        memfd.resize(2 * CHUNK_SIZE)
        memfd.close()
    assert mapped(address)
    view.release()
    del view
    gc.collect()
    assert not mapped(address), "the window outlived its last view"


def test_map_ahead_closes_a_freed_content_with_no_room_while_a_view_of_it_lives():
    """The path of the crash: the freed content is zeroed and offered as a spare, and with
    the tier's chunks taken meanwhile there is no room to keep it, so it is closed."""
    pool = DramPool(6 * CHUNK_SIZE)
    pool.ahead_chunks = 6
    try:
        fetched = Memfd()
        chunks = [pool.take(fetched, i) for i in range(4)]
        pool.add_spare(populated_memfd(2))         # what map_ahead keeps beside them
        view = memoryview(chunks[0])[:5]
        pool.give_content(fetched, chunks)         # the fetch failed: given back at once
        other = Memfd()
        taken = [pool.take(other, i) for i in range(2)]   # new writes meanwhile
        freed = pool._freed.pop()                  # map_ahead's steps, in order
        pool.add_spare(freed)                      # no room: closed (before: BufferError)
        assert freed.fd == -1 and not freed.ahead
        assert pool.free_chunks == 4 and pool.missing_chunks() == 2
        view.release()
        for chunk in taken:
            pool.give(chunk)
        other.close()
    finally:
        pool.close()
