"""DMA engines: the only way bulk bytes move between client memory and the store."""

from .engine import DmaEngine, DmaError, EngineUnavailable, Region, RegionTable

__all__ = ["DmaEngine", "DmaError", "EngineUnavailable", "Region", "RegionTable", "make_engine"]


def make_engine(name: str, doca_settings=None) -> DmaEngine:
    """`doca_settings`: the config's `doca` section (only the doca engine reads it)."""
    if name == "loopback":
        from .loopback import LoopbackEngine
        return LoopbackEngine()
    if name == "doca":   # imported only here: the loopback engine needs no cffi
        from .doca import DocaEngine
        return DocaEngine(doca_settings)
    raise ValueError(f"unknown DMA engine {name!r} (available: loopback, doca)")
