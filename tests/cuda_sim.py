"""The CUDA driver simulator (native/cuda_sim/cuda_sim.c) for machines without a GPU.

`cuda_driver()` answers which CUDA driver this process uses: the real one where a device is
there, else the simulator, built with the system C compiler and loaded by soname before
cuda-python looks for libcuda.so.1. Child processes (bluecached) find it through
LD_LIBRARY_PATH, which `activate()` sets. Nothing here is packaged: the simulator must never
shadow a real driver on a deployed machine.
"""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "native" / "cuda_sim" / "cuda_sim.c"
SONAME = "libcuda.so.1"
_active: Path | None = None      # the directory of the simulator loaded in this process


class Unavailable(Exception):
    """Neither a real CUDA device nor the simulator can be used here."""


def build(directory: Path) -> Path:
    """Compiles the simulator into `directory` (once per source version); its path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / SONAME
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        tmp = directory / (SONAME + ".tmp")
        subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                        f"-Wl,-soname,{SONAME}", "-o", str(tmp), str(SOURCE), "-lpthread"],
                       check=True, capture_output=True, text=True)
        tmp.rename(out)
    return out


def _driver_module():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise Unavailable(f"cuda-python is not installed ({e})") from None
    return driver


def real_device_count() -> int:
    """Devices of the real driver, without loading it into this process (a child asks): once
    the simulator is loaded here, the real driver can no longer be."""
    probe = ("from cuda.bindings import driver as d\n"
             "e, = d.cuInit(0)\n"
             "print(d.cuDeviceGetCount()[1] if e == d.CUresult.CUDA_SUCCESS else 0)\n")
    env = dict(os.environ)
    if _active is not None:
        env["LD_LIBRARY_PATH"] = ":".join(
            p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != str(_active))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env=env, timeout=120)
    try:
        return int(r.stdout.strip() or 0)
    except ValueError:
        return 0


def activate(directory: Path) -> Path:
    """Loads the simulator into this process and points child processes at it."""
    global _active
    lib = build(directory)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    paths = [str(directory)] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    os.environ["LD_LIBRARY_PATH"] = ":".join(paths)
    _active = directory
    return lib


def cuda_driver(directory: Path, want: str = "auto"):
    """(cuda.bindings.driver, "gpu" | "simulator"). `want`: auto (a GPU if there is one),
    gpu (skip-worthy Unavailable without one), or simulator."""
    driver = _driver_module()
    if want not in ("auto", "gpu", "simulator"):
        raise ValueError(f"want must be auto, gpu or simulator, not {want!r}")
    kind = "simulator"
    if want != "simulator" and real_device_count() > 0:
        kind = "gpu"
    elif want == "gpu":
        raise Unavailable("no CUDA device (the real driver is missing or finds none)")
    if kind == "simulator":
        activate(directory)
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise Unavailable(f"cuInit: {err!r} with the {kind}")
    return driver, kind
