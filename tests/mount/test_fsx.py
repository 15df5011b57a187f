"""An fsx-style exerciser: random sequences of the operations the mount supports, checked
against an in-memory model after every step (hypothesis stateful testing). Besides reads,
writes and names: readers the kernel serves by passthrough or O_DIRECT beside the writers,
shared mappings, hard links, fsync and evictions by the operator; an ad hoc probe of this kind
(with restarts and kills too) found five bugs in the twenty-fifth session, each with a test of
its own."""

import itertools
import mmap
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

NAMES = [f"f{i}" for i in range(5)]
MAX_SIZE = 3 << 20           # crosses the daemon's 1 MiB chunks
STEPS = 200
EXAMPLES = 60                # about 10,000 operations; more rounds run until there are

offsets = st.one_of(st.integers(0, MAX_SIZE), st.sampled_from([0, 4095, 4096, (1 << 20) - 1,
                                                               1 << 20, (1 << 20) + 1]))
sizes = st.one_of(st.integers(0, 70_000), st.sampled_from([1, 4096, 1 << 20, (1 << 20) + 3]))


class Model:
    """A file as the kernel should see it: bytes that follow the inode through renames."""

    def __init__(self):
        self.data = bytearray()


def test_random_operations_match_the_model(mounted):
    stack = mounted(**{"tiers.dram.size": "256MiB"})
    counter = itertools.count()
    ops_run = [0]

    class Exerciser(RuleBasedStateMachine):
        handles = Bundle("handles")

        def __init__(self):
            super().__init__()
            self.dir = os.path.join(stack.mnt, f"run{next(counter)}")
            os.mkdir(self.dir)
            self.names: dict[str, Model] = {}
            self.fds: dict[int, Model] = {}
            self.readers: set[int] = set()     # read-only fds (O_DIRECT ones in `direct`)
            self.direct: set[int] = set()

        def path(self, name):
            return os.path.join(self.dir, name)

        @rule(target=handles, name=st.sampled_from(NAMES), trunc=st.booleans())
        def create_or_open(self, name, trunc):
            ops_run[0] += 1
            flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0)
            fd = os.open(self.path(name), flags, 0o644)
            model = self.names.setdefault(name, Model())
            if trunc:
                model.data.clear()
            self.fds[fd] = model
            return fd

        @precondition(lambda self: self.names)
        @rule(target=handles, data=st.data(), direct=st.booleans())
        def open_reader(self, data, direct):
            # a passthrough reader makes the inode's memfd the kernel's for every handle
            ops_run[0] += 1
            name = data.draw(st.sampled_from(sorted(self.names)))
            fd = os.open(self.path(name), os.O_RDONLY | (os.O_DIRECT if direct else 0))
            self.fds[fd] = self.names[name]
            self.readers.add(fd)
            if direct:
                self.direct.add(fd)
            return fd

        @rule(fd=handles, offset=offsets, size=sizes, seed=st.integers(0, 255))
        def write(self, fd, offset, size, seed):
            if fd not in self.fds or fd in self.readers:
                return
            ops_run[0] += 1
            data = bytes((seed + i) % 251 for i in range(min(size, 256))) * (size // 256 + 1)
            data = data[:size]
            assert os.pwrite(fd, data, offset) == size
            model = self.fds[fd].data
            if size:
                if len(model) < offset:
                    model.extend(bytes(offset - len(model)))
                model[offset:offset + size] = data

        @rule(fd=handles, size=st.integers(0, MAX_SIZE))
        def truncate(self, fd, size):
            if fd not in self.fds or fd in self.readers:
                return
            ops_run[0] += 1
            os.ftruncate(fd, size)
            model = self.fds[fd].data
            if size < len(model):
                del model[size:]
            else:
                model.extend(bytes(size - len(model)))

        @rule(fd=handles, offset=offsets, size=sizes)
        def read(self, fd, offset, size):
            if fd not in self.fds:
                return
            ops_run[0] += 1
            if fd in self.direct:   # aligned, into page-aligned memory
                offset, size = offset & ~4095, max(4096, (size + 4095) & ~4095)
                with mmap.mmap(-1, size) as buf:
                    n = os.preadv(fd, [buf], offset)
                    got = buf[:n]
            else:
                got = os.pread(fd, size, offset)
            assert got == bytes(self.fds[fd].data[offset:offset + size])

        @rule(fd=handles, at=st.floats(0, 1), size=st.integers(1, 70_000),
              seed=st.integers(0, 255))
        def through_a_mapping(self, fd, at, size, seed):
            """A shared mapping of the file: written (msync'd) on a write handle, else read."""
            if fd not in self.fds or not self.fds[fd].data:
                return
            ops_run[0] += 1
            model = self.fds[fd].data
            offset = int(at * (len(model) - 1))
            size = min(size, len(model) - offset)
            writable = fd not in self.readers
            with mmap.mmap(fd, len(model), access=mmap.ACCESS_WRITE if writable
                           else mmap.ACCESS_READ) as m:
                if writable:
                    data = bytes((seed + i) % 253 for i in range(size))
                    m[offset:offset + size] = data
                    m.flush()
                    model[offset:offset + size] = data
                else:
                    assert m[offset:offset + size] == bytes(model[offset:offset + size])

        @rule(fd=handles)
        def fsync(self, fd):
            if fd in self.fds and fd not in self.readers:
                ops_run[0] += 1
                os.fsync(fd)

        @rule(fd=consumes(handles))
        def close(self, fd):
            if fd in self.fds:
                ops_run[0] += 1
                os.close(fd)
                del self.fds[fd]
                self.readers.discard(fd)
                self.direct.discard(fd)

        @precondition(lambda self: self.names)
        @rule(data=st.data(), new=st.sampled_from(NAMES))
        def link(self, data, new):
            ops_run[0] += 1
            old = data.draw(st.sampled_from(sorted(self.names)))
            if new in self.names:
                with pytest.raises(FileExistsError):
                    os.link(self.path(old), self.path(new))
                return
            os.link(self.path(old), self.path(new))
            self.names[new] = self.names[old]

        @precondition(lambda self: self.names)
        @rule(data=st.data())
        def evict(self, data):
            """bluecachectl evict: a file nobody has open goes with all its names."""
            ops_run[0] += 1
            name = data.draw(st.sampled_from(sorted(self.names)))
            model = self.names[name]
            removed = client.call("evict", path=f"/{os.path.basename(self.dir)}/{name}")
            if removed["removed"]:
                assert model not in self.fds.values(), "an open file was evicted"
                for n in [n for n, m in self.names.items() if m is model]:
                    del self.names[n]

        @precondition(lambda self: self.names)
        @rule(data=st.data(), new=st.sampled_from(NAMES))
        def rename(self, data, new):
            ops_run[0] += 1
            old = data.draw(st.sampled_from(sorted(self.names)))
            os.rename(self.path(old), self.path(new))
            if old != new and self.names.get(new) is not self.names[old]:   # (two links of
                self.names[new] = self.names.pop(old)                       # one: no-op)

        @precondition(lambda self: self.names)
        @rule(data=st.data())
        def unlink(self, data):
            ops_run[0] += 1
            name = data.draw(st.sampled_from(sorted(self.names)))
            os.unlink(self.path(name))
            del self.names[name]          # open handles keep the model alive

        @invariant()
        def names_and_sizes_agree(self):
            assert sorted(os.listdir(self.dir)) == sorted(self.names)
            for name, model in self.names.items():
                st_ = os.stat(self.path(name))
                assert st_.st_size == len(model.data)
                assert st_.st_nlink == sum(m is model for m in self.names.values())

        def teardown(self):
            try:
                for name, model in self.names.items():     # whole-file check by path
                    with open(self.path(name), "rb") as f:
                        assert f.read() == bytes(model.data), name
            finally:
                for fd in self.fds:
                    os.close(fd)

    # Hypothesis decides how many steps each example takes, so the count varies: another
    # round (fresh random examples) until at least 10,000 operations were checked.
    client = stack.daemon.client()
    try:
        for _ in range(5):
            run_state_machine_as_test(Exerciser, settings=settings(
                max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                suppress_health_check=list(HealthCheck)))
            if ops_run[0] >= 10_000:
                break
    finally:
        client.close()
    assert ops_run[0] >= 10_000
