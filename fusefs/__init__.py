"""fusefs: the POSIX face of bluecache, and every reply the kernel gets.

operations.py answers pyfuse3's requests, inplace.py the writes the fuse shim reads into
staging, ioctl.py the zero-copy ioctl, passthrough.py which opens the kernel serves from the
cache's memfd itself; errors.py is the one errno map behind them all. Knows
nothing of zmq, DOCA or CUDA: hostd hands it a `Cache` (cache.py), its staging slots
(`SlotWriter`) and the ioctl's transfers (`Transfers`), and the fuse shim it loaded.
"""

from .cache import Attr, Cache
from .operations import Operations, Timeouts

__all__ = ["Attr", "Cache", "Operations", "Timeouts"]
