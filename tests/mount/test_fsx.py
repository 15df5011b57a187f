"""An fsx-style exerciser: random sequences of the operations the mount supports, checked
against an in-memory model after every step (hypothesis stateful testing)."""

import itertools
import os

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

        @rule(fd=handles, offset=offsets, size=sizes, seed=st.integers(0, 255))
        def write(self, fd, offset, size, seed):
            if fd not in self.fds:
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
            if fd not in self.fds:
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
            expected = bytes(self.fds[fd].data[offset:offset + size])
            assert os.pread(fd, size, offset) == expected

        @rule(fd=consumes(handles))
        def close(self, fd):
            if fd in self.fds:
                ops_run[0] += 1
                os.close(fd)
                del self.fds[fd]

        @precondition(lambda self: self.names)
        @rule(data=st.data(), new=st.sampled_from(NAMES))
        def rename(self, data, new):
            ops_run[0] += 1
            old = data.draw(st.sampled_from(sorted(self.names)))
            os.rename(self.path(old), self.path(new))
            if old != new:
                self.names[new] = self.names.pop(old)

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
                assert os.stat(self.path(name)).st_size == len(model.data)

        def teardown(self):
            for name, model in self.names.items():     # whole-file check by path
                with open(self.path(name), "rb") as f:
                    assert f.read() == bytes(model.data), name
            for fd in self.fds:
                os.close(fd)

    # Hypothesis decides how many steps each example takes, so the count varies: another
    # round (fresh random examples) until at least 10,000 operations were checked.
    for _ in range(5):
        run_state_machine_as_test(Exerciser, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
            suppress_health_check=list(HealthCheck)))
        if ops_run[0] >= 10_000:
            break
    assert ops_run[0] >= 10_000
