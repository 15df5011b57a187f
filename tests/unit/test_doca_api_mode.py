"""The DOCA binding in API mode (what the DPU builds against the SDK's headers), compiled here
against the DOCA API simulator's header and linked to the simulator: the same declarations, a
real C compiler checking them, `union doca_data` passed by value. No BlueField involved."""

import importlib.util
import sys
from pathlib import Path

import trio
from test_dma_engines import Host, doca_settings

from bluecached.dma import RegionTable, doca_binding, make_engine
from support import MiB, pattern, run

ROOT = Path(__file__).resolve().parents[2]


def build_api_module(tmp_path):
    sys.path.insert(0, str(ROOT / "native"))
    try:
        import build_doca_api
    finally:
        sys.path.remove(str(ROOT / "native"))
    sim = Path(doca_binding.simulator_path())
    ffi = build_doca_api.make_ffi("simulator", [str(sim), f"-Wl,-rpath,{sim.parent}"])
    path = ffi.compile(tmpdir=str(tmp_path))
    spec = importlib.util.spec_from_file_location("bluecached.dma._doca_api", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_api_mode_binding_moves_bytes(tmp_path, monkeypatch):
    module, path = build_api_module(tmp_path)
    api = doca_binding.DocaLibrary(module.ffi, module.lib, True, path, simulated=True)
    assert api.api_mode and "API mode" in api.description
    assert api.error(27, "x").name == "DOCA_ERROR_TOO_BIG"
    data = api.data(7)
    assert data.u64 == 7          # a real union, passed by value
    # both the engine (DPU side) and the exporter (host side) use the API-mode library
    monkeypatch.setitem(doca_binding._loaded, "simulator", api)

    async def main():
        engine = make_engine("doca", doca_settings())
        assert engine.doca is api
        table = RegionTable(engine)
        host = Host(engine, 4 * MiB)
        assert host.exporter.doca is api
        host.view[:] = pattern("api", 4 * MiB)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.serve)
            region = table.add(engine.register(host.source))
            store = [memoryview(bytearray(MiB)) for _ in range(4)]
            await engine.to_store(region, 0, store)
            assert b"".join(bytes(s) for s in store) == pattern("api", 4 * MiB)
            await engine.from_store(store[::-1], region, 0)
            assert host.view[:MiB] == pattern("api", 4 * MiB)[3 * MiB:]
            table.remove(region.id)
            nursery.cancel_scope.cancel()
        host.close()

    run(main)
