"""The fuse shim (native/fuse_shim.c, built into hostd._fuse_shim): loaded before pyfuse3.

The shim defines libfuse's fuse_session_new; loaded RTLD_GLOBAL before pyfuse3, it is the one
pyfuse3 resolves, and so can add the ioctl handler, receive writes in place, read requests
in a thread of its own and negotiate passthrough. fusefs uses it (inplace.py, ioctl.py,
passthrough.py), handed the module by hostd.
"""

import os
import sys


def load_shim():
    """Loads the shim before pyfuse3 so that pyfuse3's fuse_session_new resolves to it.
    Returns (module, None) or (None, reason)."""
    if "pyfuse3" in sys.modules:
        return None, "pyfuse3 was imported before the ioctl shim"
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from . import _fuse_shim
    except ImportError as e:
        return None, f"the ioctl shim is not built ({e}); reinstall with libfuse3-dev present"
    finally:
        sys.setdlopenflags(flags)
    return _fuse_shim, None
