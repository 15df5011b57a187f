"""The replies fusefs writes through the fuse shim: writes received in place and the zero-copy
ioctl. A fake shim stands in for the cffi module (it records the callbacks fusefs registers
and the replies it sends); fake staging and transfers stand in for hostd."""

import errno
import functools
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from fusefs.errors import Refused
from fusefs.inplace import InPlaceWrites
from fusefs.ioctl import FUSE_IOCTL_DIR, IoctlDispatch


class FakeFfi:
    def __init__(self):
        self.externs = {}

    def def_extern(self, error=None):
        def register(fn):
            self.externs[fn.__name__] = fn
            return fn
        return register

    @staticmethod
    def cast(ctype, value):
        return value

    @staticmethod
    def buffer(data, size):
        return data[:size]


class FakeLib:
    """The shim's C functions fusefs calls: replies are recorded as (req, kind, value)."""

    def __init__(self):
        self.replies = []
        self.receiving = None
        self.held_slots = []

    def fuse_reply_write(self, req, size):
        self.replies.append((req, "write", size))

    def fuse_reply_err(self, req, err):
        self.replies.append((req, "err", err))

    def fuse_reply_ioctl(self, req, result, buf, size):
        self.replies.append((req, "ioctl", bytes(buf[:size])))

    def fuse_req_ctx(self, req):
        return SimpleNamespace(pid=4242)

    def bc_receive_into(self, base, slots, stride, head):
        self.receiving = (base, slots, stride, head)
        return 0

    def bc_receive_stop(self):
        return self.held_slots.pop() if self.held_slots else -1

    def bc_writes_in_place(self):
        return 5

    def bc_writes_copied(self):
        return 1

    def bc_shim_state(self):
        return 1


@pytest.fixture
def shim():
    return SimpleNamespace(ffi=FakeFfi(), lib=FakeLib())


# -- writes received in place ---------------------------------------------------------------

class FakeStaging:
    slots, stride, head = 4, 1 << 21, 4096

    def __init__(self):
        self.free = list(range(self.slots))

    def address(self):
        return 0x7F0000000000

    def take_nowait(self):
        return self.free.pop() if self.free else -1

    def give(self, slot):
        self.free.append(slot)


class FakeWriter:
    """hostd's side: takes the write, answers at once with `outcome` (None: stored)."""

    def __init__(self, outcome=None):
        self.staging = FakeStaging()
        self.outcome = outcome
        self.writes = []

    def write_in_slot(self, fh, offset, slot, length, answer):
        if isinstance(self.outcome, Exception) and not isinstance(self.outcome, OSError):
            raise self.outcome
        self.writes.append((fh, offset, slot, length))
        self.staging.give(slot)
        answer(self.outcome)


@pytest.mark.parametrize("outcome, reply", [
    (None, ("write", 1 << 20)),
    (OSError(errno.ENOSPC, "no room"), ("err", errno.ENOSPC)),
    (OSError(errno.EFBIG, "too large"), ("err", errno.EFBIG)),
    (OSError(errno.ETIMEDOUT, "no answer"), ("err", errno.EIO)),
    (OSError(errno.EFAULT, "staging span refused"), ("err", errno.EIO)),
    (RuntimeError("a bug in hostd"), ("err", errno.EIO)),
])
def test_a_write_in_a_slot_is_answered_by_the_errno_map(shim, outcome, reply):
    writer = FakeWriter(outcome)
    InPlaceWrites(shim, writer)
    externs = shim.ffi.externs
    slot = externs["bc_take_slot"]()
    assert slot >= 0 and slot not in writer.staging.free
    externs["bc_write_to_python"]("req1", 9, 3, 4096, slot, 1 << 20)
    assert shim.lib.replies == [("req1", *reply)]
    if not isinstance(outcome, RuntimeError):
        assert writer.writes == [(3, 4096, slot, 1 << 20)]


def test_in_place_receiving_starts_on_the_slots_and_gives_them_back_at_stop(shim):
    writer = FakeWriter()
    in_place = InPlaceWrites(shim, writer)
    externs = shim.ffi.externs
    assert in_place.start() is None and in_place.active
    assert shim.lib.receiving == (0x7F0000000000, 4, 1 << 21, 4096)
    shim.lib.held_slots = [externs["bc_take_slot"](), externs["bc_take_slot"]()]
    externs["bc_give_slot"](externs["bc_take_slot"]())
    assert len(writer.staging.free) == 2
    in_place.stop()
    assert sorted(writer.staging.free) == [0, 1, 2, 3] and not in_place.active
    assert in_place.counts() == {"in_place": 5, "copied": 1}


def test_an_empty_pool_is_minus_one_for_the_shim(shim):
    writer = FakeWriter()
    writer.staging.free.clear()
    InPlaceWrites(shim, writer)
    assert shim.ffi.externs["bc_take_slot"]() == -1


# -- the ioctl --------------------------------------------------------------------------------

STORE, QUERY = 0xC0DE0001, 0xC0DE0003


class FakeTransfers:
    commands = frozenset({STORE, QUERY})
    changing = frozenset({STORE})

    def __init__(self, outcome):
        self.outcome = outcome
        self.served = []

    async def serve(self, cmd, fh, request, pid):
        self.served.append((cmd, fh, request, pid))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _ioctl(shim, transfers, cmd, flags=0, request=b"req", out_size=64, forget=None):
    """One ioctl through the dispatch, as the shim delivers it (on inode 9): the reply the
    kernel got."""
    dispatch = IoctlDispatch(shim, transfers, forget)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(dispatch.run)
            shim.ffi.externs["bc_ioctl_to_python"]("req7", 9, cmd, 3, flags, request,
                                                    len(request), out_size)
            await trio.testing.wait_all_tasks_blocked()   # the request's task is done
            nursery.cancel_scope.cancel()

    trio.run(main, strict_exception_groups=True)
    [reply] = shim.lib.replies
    assert reply[0] == "req7"
    return reply[1:]


@pytest.mark.parametrize("outcome, reply", [
    (b"reply struct", ("ioctl", b"reply struct")),
    (Refused(errno.EINVAL, "bad version"), ("err", errno.EINVAL)),
    (Refused(errno.EFAULT, "span beyond the memfd"), ("err", errno.EFAULT)),
    (OSError(errno.EFAULT, "span outside the CUDA allocation"), ("err", errno.EFAULT)),
    (OSError(errno.ENOENT, "evicted"), ("err", errno.ENOENT)),
    (OSError(errno.ETIMEDOUT, "no answer"), ("err", errno.EIO)),
    (OSError(errno.EPROTO, "say hello first"), ("err", errno.EIO)),
    (RuntimeError("a bug in hostd"), ("err", errno.EIO)),
])
def test_an_ioctl_is_answered_by_the_errno_map(shim, outcome, reply):
    transfers = FakeTransfers(outcome)
    assert _ioctl(shim, transfers, STORE) == reply
    assert transfers.served == [(STORE, 3, b"req", 4242)]


@pytest.mark.parametrize("cmd, outcome, forgets", [
    (STORE, b"reply struct", True),
    (STORE, OSError(errno.ENOSPC, "DRAM full"), True),     # cheap, whatever it did
    (STORE, Refused(errno.EINVAL, "bad version"), False),  # refused as asked: untouched
    (QUERY, b"reply struct", False),
])
def test_a_store_drops_the_kernels_attributes_of_the_file_before_the_reply(
        shim, cmd, outcome, forgets):
    # The kernel keeps a new file's size 0 for the attribute timeout: unless told, a reader's
    # lseek(SEEK_END) right after the STORE finds 0 bytes (llm-d's reader does just that).
    forgotten = []   # (inode, replies sent by then)
    _ioctl(shim, FakeTransfers(outcome), cmd,
           forget=lambda ino: forgotten.append((ino, len(shim.lib.replies))))
    assert forgotten == ([(9, 0)] if forgets else [])


def test_an_ioctl_reply_is_cut_to_the_callers_buffer(shim):
    assert _ioctl(shim, FakeTransfers(b"0123456789"), QUERY, out_size=4) == ("ioctl", b"0123")


@pytest.mark.parametrize("cmd, flags", [(0x5401, 0), (STORE, FUSE_IOCTL_DIR)])
def test_other_ioctls_and_directories_get_enotty(shim, cmd, flags):
    """0x5401 is the TCGETS every buffered open() sends."""
    transfers = FakeTransfers(b"never")
    assert _ioctl(shim, transfers, cmd, flags) == ("err", errno.ENOTTY)
    assert transfers.served == []


def test_a_dispatch_that_cannot_start_a_task_answers_eio(shim):
    IoctlDispatch(shim, FakeTransfers(b""))   # never run: no nursery to start the task in
    shim.ffi.externs["bc_ioctl_to_python"]("req8", 9, STORE, 3, 0, b"", 0, 64)
    assert shim.lib.replies == [("req8", "err", errno.EIO)]


@pytest.mark.parametrize("state, says", [(1, "ioctl available"),
                                         (-1, "operations table is newer"),
                                         (0, "did not call the shim's fuse_session_new")])
def test_the_shim_state_in_words(shim, state, says):
    shim.lib.bc_shim_state = functools.partial(int, state)
    shim.lib.fuse_version = functools.partial(int, 314)
    assert says in IoctlDispatch(shim, FakeTransfers(b"")).state()
