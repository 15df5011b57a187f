"""Shared memory the cache daemon can map: a sealed memfd.

Standard library only: hostd.zerocopy, the library an application (vLLM) imports, uses it, and
must not pull the daemon's dependencies (zmq, trio, msgpack) into every such process.
"""

import fcntl
import mmap
import os

from .huge_pages import populate_huge


class SharedRegion:
    """A sealed memfd mapped here; registered with the daemon it becomes a DMA region."""

    def __init__(self, length: int, name: str = "bluecache-region", huge: bool = False):
        """`huge`: ask for 2 MiB pages (where the kernel's shmem policy grants them: see
        bluecached/huge_pages.py) and allocate every page now, so they are taken while that
        mapping asks: a page the daemon's mapping or an O_DIRECT read faults in later would
        be a 4 KiB one."""
        self.length = length
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, length)
            # Sealed size: the daemon maps [0, length) and must never see it shrink under it.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, length)
            if huge:
                populate_huge(self.map)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)
