"""fusefs.Operations called directly (no kernel): what it answers without asking the cache."""

import errno

import pyfuse3
import pytest

from fusefs.operations import Operations
from support import run


def test_fusefs_answers_enametoolong_for_the_names_it_refuses_itself():
    """symlink, link and mknod of a non-file never reach the cache: the length comes first."""
    ops = Operations(cache=None)

    async def refused(name: bytes) -> list[int]:
        out = []
        for call in (lambda: ops.symlink(1, name, b"target", None),
                     lambda: ops.link(5, 1, name, None),
                     lambda: ops.mknod(1, name, 0o10644, 0, None)):   # a fifo
            with pytest.raises(pyfuse3.FUSEError) as e:
                await call()
            out.append(e.value.errno)
        return out

    assert run(refused, b"n" * 256) == [errno.ENAMETOOLONG] * 3
    assert run(refused, b"n" * 255) == [errno.EPERM] * 3
