"""bluecached: the bluecache cache daemon (namespace, tiers, eviction, integrity, DMA)."""

import functools


@functools.cache
def _installed_version() -> str:
    """The version in the installed package's metadata (the .deb's, or pip's for a checkout
    installed with `pip install -e`)."""
    from importlib import metadata
    try:
        return metadata.version("bluecache")
    except metadata.PackageNotFoundError:   # run from a tree that was never installed
        return "0+unknown"


def __getattr__(name: str):
    # Looked up on first use only: hostd/zerocopy.py imports bluecached/shm.py into every
    # application process, which should not pay for a search of sys.path's metadata.
    if name == "__version__":
        return _installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
