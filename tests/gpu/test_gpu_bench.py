"""bench/gpu_bench.py runs end to end (on the CUDA driver simulator: a smoke test of the
script, not a measurement; nothing here is timed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_runs_and_moves_the_bytes_on_the_simulator(tmp_path):
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu_bench.py"), "--simulator",
                        "--blocks", "2", "--size-mib", "2", "--rounds", "1",
                        "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert out["simulated"] is True and "simulated" in out["machine"]["device"]
    assert out["bytes_ok"] is True
    assert set(out["results_mib_s"]) == {"cumemcpy", "ioctl", "posix_pinned"}
    assert all(v > 0 for r in out["results_mib_s"].values() for v in r.values())
    ipc = out["ipc_open_close"]
    assert 0 < ipc["median_us"] <= ipc["max_us"] and ipc["share_of_block_dtoh"] > 0
