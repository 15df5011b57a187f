"""Which set-user-ID/set-group-ID bits a write or truncate by a user without CAP_FSETID clears.
bluecached applies the rule to writes, fusefs to open(O_TRUNC): both copies must agree."""

import stat

import pytest

from bluecached import namespace
from fusefs import operations


@pytest.mark.parametrize("mode, after", [
    (0o4777, 0o777), (0o2777, 0o777), (0o6777, 0o777), (0o6755, 0o755), (0o2757, 0o757),
    (0o4700, 0o700),
    (0o2767, 0o2767), (0o6745, 0o2745),   # S_ISGID without group execute: mandatory locking
    (0o1777, 0o1777), (0o777, 0o777), (0o644, 0o644),
])
def test_the_rule(mode, after):
    for rule in (namespace.mode_after_unprivileged_write, operations.mode_after_unprivileged_write):
        assert rule(stat.S_IFREG | mode) == stat.S_IFREG | after


def test_both_copies_agree_on_every_mode():
    for mode in range(0o10000):
        assert (namespace.mode_after_unprivileged_write(stat.S_IFREG | mode)
                == operations.mode_after_unprivileged_write(stat.S_IFREG | mode))
