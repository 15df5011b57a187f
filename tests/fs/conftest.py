"""tests/fs: fusefs.Operations driven in-process against an in-memory cache (memory_cache.py),
the kernel's side played by fake_kernel.py. No kernel, no daemon: what fusefs itself answers."""

import pytest
from fake_kernel import TIMEOUTS, Kernel
from memory_cache import MemoryCache

from fusefs import Operations


@pytest.fixture
def cache() -> MemoryCache:
    return MemoryCache()


@pytest.fixture
def ops(cache) -> Operations:
    return Operations(cache, TIMEOUTS)


@pytest.fixture
def kernel(ops) -> Kernel:
    return Kernel(ops)
