"""DMA engines: the only way bulk bytes move between client memory and the store."""

from .engine import DmaEngine, DmaError, Region, RegionTable

__all__ = ["DmaEngine", "DmaError", "Region", "RegionTable", "make_engine"]


def make_engine(name: str) -> DmaEngine:
    if name == "loopback":
        from .loopback import LoopbackEngine
        return LoopbackEngine()
    raise ValueError(f"unknown DMA engine {name!r} (available: loopback)")
