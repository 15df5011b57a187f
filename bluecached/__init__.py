"""bluecached: the bluecache cache daemon (namespace, tiers, eviction, integrity, DMA)."""

__version__ = "0.1.0"
