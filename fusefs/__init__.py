"""fusefs: the POSIX face of bluecache, as pyfuse3 Operations over an abstract cache client.

Knows nothing of zmq, DOCA or CUDA: hostd hands it a `Cache` (see cache.py).
"""

from .cache import Attr, Cache
from .operations import Operations, Timeouts

__all__ = ["Attr", "Cache", "Operations", "Timeouts"]
