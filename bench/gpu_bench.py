"""GPU memory to and from the cache: the zero-copy ioctl vs cuMemcpy with pinned memory vs the
POSIX path fed from pinned memory, for 32 MiB KV blocks, in one run.

    python bench/gpu_bench.py [--blocks 16] [--size-mib 32] [--rounds 3] [--out-dir DIR]
    python bench/gpu_bench.py --simulator ...   # no GPU: a smoke run, the numbers mean nothing

Starts bluecached + hostd (bench/harness.py) mounting a temp dir; one device buffer
(cuMemAlloc) and one page-locked host buffer (cuMemAllocHost) of a block each. Per round, for
`--blocks` files:
  cumemcpy      the baseline: cuMemcpyDtoH into the pinned buffer (store), HtoD (load)
  ioctl         hostd.zerocopy.store_from / load_into with the device buffer: bluecached opens
                its IPC handle and the GPU copies into / out of the store's chunks
  posix_pinned  what vLLM's FS tier does: DtoH into pinned memory, then open/write/rename
                through the mount; load: read into pinned memory, then HtoD
Then, apart: what bluecached pays per request to open and close the client's IPC handle
(cuIpcOpenMemHandle + cuMemGetAddressRange + cuIpcCloseMemHandle, timed in a child process
through bluecached's own code), as a share of one block's cuMemcpy: the number that says
whether handles should be kept open between requests (docs/hardware.md).
Targets from the issue: ioctl store and load >= 0.8x cuMemcpy DtoH / HtoD with pinned memory.
Writes gpu.json, gpu.md and gpu.png to --out-dir (docs/benchmarks by default), naming the device.
With --simulator (tests/cuda_sim.py) it runs without a GPU to prove the script works; its
results go to a temporary directory unless --out-dir is given, and say they are simulated.
"""

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import yaml
from harness import Bluecached, Hostd, MiB, force_unmount, pattern
from ioctl_bench import posix_load, posix_store, timed

from hostd.zerocopy import _handle_bytes, load_into, store_from

# The CUDA driver simulator is test tooling (it must never ship): found in tests/, by path.
sys.path.append(str(harness.ROOT / "tests"))
import cuda_sim  # noqa: E402


class Cuda:
    """The few driver calls the benchmark makes, each checked."""

    def __init__(self, driver):
        self.d = driver
        self.device = self.ok(driver.cuDeviceGet(0))
        driver.cuCtxSetCurrent(self.ok(driver.cuDevicePrimaryCtxRetain(self.device)))

    def ok(self, result):
        err, *values = result
        if err != self.d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA call failed: {err!r}")
        return values[0] if len(values) == 1 else values

    def name(self) -> str:
        raw = self.ok(self.d.cuDeviceGetName(128, self.device))
        return raw.split(b"\0")[0].decode().strip()

    def driver_version(self) -> int:
        return int(self.ok(self.d.cuDriverGetVersion()))

    def dtoh(self, host: int, device: int, n: int) -> None:
        self.ok(self.d.cuMemcpyDtoH(host, self.d.CUdeviceptr(device), n))

    def htod(self, device: int, host: int, n: int) -> None:
        self.ok(self.d.cuMemcpyHtoD(self.d.CUdeviceptr(device), host, n))


class DeviceBlock:
    """A cuMemAlloc'd block, handed to the ioctl through __cuda_array_interface__."""

    def __init__(self, cuda: Cuda, size: int):
        self.cuda, self.size = cuda, size
        self.ptr = int(cuda.ok(cuda.d.cuMemAlloc(size)))

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None}

    def free(self) -> None:
        self.cuda.ok(self.cuda.d.cuMemFree(self.cuda.d.CUdeviceptr(self.ptr)))


class PinnedBlock:
    """cuMemAllocHost memory, also a writable Python buffer (for os.write / readv)."""

    def __init__(self, cuda: Cuda, size: int):
        self.cuda, self.size = cuda, size
        self.ptr = int(cuda.ok(cuda.d.cuMemAllocHost(size)))
        self.view = memoryview((ctypes.c_char * size).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        self.view.release()
        self.cuda.ok(self.cuda.d.cuMemFreeHost(self.ptr))


def ipc_open_close_us(handle: bytes, repeats: int) -> list[float]:
    """Microseconds per open + close of `handle`, timed in a child process (a process cannot
    open its own handle) with bluecached's CudaContext, so exactly the calls it makes."""
    r = subprocess.run([sys.executable, __file__, "--ipc-child", handle.hex(),
                        "--rounds", str(repeats)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"IPC open/close child failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def ipc_child(handle_hex: str, repeats: int) -> int:
    from bluecached.dma.cuda import CudaContext
    ctx, handle, times = CudaContext(0), bytes.fromhex(handle_hex), []
    for _ in range(repeats):
        t = time.perf_counter()
        base, _ = ctx.open_ipc(handle)
        ctx.close_ipc(base)
        times.append((time.perf_counter() - t) * 1e6)
    print(json.dumps(times))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="repeat each phase, keep the best")
    ap.add_argument("--out-dir", type=Path, help="default: docs/benchmarks (a temporary "
                                                 "directory with --simulator)")
    ap.add_argument("--simulator", action="store_true",
                    help="run on the CUDA driver simulator (no GPU; numbers meaningless)")
    ap.add_argument("--daemon", action="append", default=[], metavar="KEY=VALUE",
                    help="a bluecached setting for the run (repeatable; VALUE as in YAML)")
    ap.add_argument("--ipc-child", metavar="HANDLE_HEX", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ipc_child:
        return ipc_child(args.ipc_child, args.rounds)
    size, total_mib = args.size_mib * MiB, args.blocks * args.size_mib
    work = Path(tempfile.mkdtemp(prefix="bcgpu-", dir="/var/tmp"))
    out_dir = args.out_dir or (work.with_name(work.name + "-out") if args.simulator
                               else harness.ROOT / "docs/benchmarks")
    try:
        driver, kind = cuda_sim.cuda_driver(work / "cuda-sim",
                                            "simulator" if args.simulator else "gpu")
    except cuda_sim.Unavailable as e:
        print(f"gpu_bench: {e}. This benchmark measures a GPU; --simulator runs it without "
              "one as a smoke test.", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    cuda = Cuda(driver)
    device = cuda.name() + (" (simulated: no GPU, copies by the CPU)" if kind != "gpu" else "")
    print(f"device: {device}", flush=True)
    dram = f"{max(2 * total_mib, 512)}MiB"
    settings = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.daemon)}
    daemon = Bluecached(work / "d", **{"tiers.dram.size": dram, "tiers.nvme.size": "8GiB",
                                       "tiers.nvme.segment_size": "1GiB", **settings})
    hostd = Hostd(daemon, work / "mnt")   # stopped in finally, whatever failed
    started = time.time()
    results: dict[str, dict[str, float]] = {}
    dev = pinned = None
    try:
        daemon.start()
        hostd.start()
        mnt = work / "mnt"
        dev, pinned = DeviceBlock(cuda, size), PinnedBlock(cuda, size)
        pinned.view[:] = pattern("gpu-bench", size)
        cuda.htod(dev.ptr, pinned.ptr, size)

        def pinned_store(path):
            cuda.dtoh(pinned.ptr, dev.ptr, size)
            posix_store(path, pinned.view)

        def pinned_load(path):
            posix_load(path, pinned.view)
            cuda.htod(dev.ptr, pinned.ptr, size)

        targets = {
            "cumemcpy": (lambda p: cuda.dtoh(pinned.ptr, dev.ptr, size),
                         lambda p: cuda.htod(dev.ptr, pinned.ptr, size), None),
            "ioctl": (lambda p: store_from(p, dev), lambda p: load_into(p, dev), mnt / "ioctl"),
            "posix_pinned": (pinned_store, pinned_load, mnt / "posix"),
        }
        for name, (store, load, where) in targets.items():
            if where is not None:
                where.mkdir()
            best_store = best_load = float("inf")
            for r in range(args.rounds):
                paths = [str((where or work) / f"r{r}_b{i}.bin") for i in range(args.blocks)]
                best_store = min(best_store, timed(store, paths))
                best_load = min(best_load, timed(load, paths))
                if where is not None:
                    for p in paths:
                        os.unlink(p)
            results[name] = {"store_mib_s": round(total_mib / best_store, 1),
                             "load_mib_s": round(total_mib / best_load, 1)}
            print(f"{name:12} store {results[name]['store_mib_s']:9.1f} MiB/s   "
                  f"load {results[name]['load_mib_s']:9.1f} MiB/s", flush=True)
        # the bytes made the whole trip: device -> cache -> device -> pinned
        check = str(mnt / "check.bin")
        store_from(check, dev)
        pinned.view[:] = bytes(size)
        cuda.htod(dev.ptr, pinned.ptr, size)
        load_into(check, dev)
        cuda.dtoh(pinned.ptr, dev.ptr, size)
        bytes_ok = bytes(pinned.view) == pattern("gpu-bench", size)
        hostd.stop()
        handle = _handle_bytes(cuda.ok(cuda.d.cuIpcGetMemHandle(cuda.d.CUdeviceptr(dev.ptr))))
        opens = sorted(ipc_open_close_us(handle, 50))
    finally:
        if dev is not None:
            dev.free()
        if pinned is not None:
            pinned.free()
        hostd.stop()
        daemon.stop()
        force_unmount(work / "mnt")
        shutil.rmtree(work, ignore_errors=True)
    def ratio(phase: str, baseline: str) -> float:
        return round(results["ioctl"][phase] / results[baseline][phase], 2)

    ratios = {
        "ioctl_store_vs_cumemcpy_dtoh": ratio("store_mib_s", "cumemcpy"),
        "ioctl_load_vs_cumemcpy_htod": ratio("load_mib_s", "cumemcpy"),
        "ioctl_store_vs_posix_pinned": ratio("store_mib_s", "posix_pinned"),
        "ioctl_load_vs_posix_pinned": ratio("load_mib_s", "posix_pinned"),
    }
    block_copy_us = args.size_mib / results["cumemcpy"]["store_mib_s"] * 1e6
    ipc = {"median_us": round(opens[len(opens) // 2], 1), "max_us": round(opens[-1], 1),
           "share_of_block_dtoh": round(opens[len(opens) // 2] / block_copy_us, 3)}
    print(f"IPC open+close per request: median {ipc['median_us']} us, "
          f"{ipc['share_of_block_dtoh']:.1%} of one block's cuMemcpy DtoH", flush=True)
    targets_met = {
        "ioctl store >= 0.8x cuMemcpy DtoH": ratios["ioctl_store_vs_cumemcpy_dtoh"] >= 0.8,
        "ioctl load >= 0.8x cuMemcpy HtoD": ratios["ioctl_load_vs_cumemcpy_htod"] >= 0.8,
    }
    out = harness.run_info("gpu_bench", device=device,
                           cuda_driver_version=cuda.driver_version())
    out.update({
        "simulated": kind != "gpu", "block_mib": args.size_mib, "blocks": args.blocks,
        "daemon_settings": settings,
        "rounds": args.rounds, "results_mib_s": results, "ratios": ratios,
        "targets_met": targets_met, "bytes_ok": bytes_ok, "ipc_open_close": ipc,
        "seconds": round(time.time() - started, 1)})
    print(json.dumps({"ratios": ratios, "targets_met": targets_met, "bytes_ok": bytes_ok},
                     indent=2))
    harness.write_block_results(
        out_dir, "gpu", out, "GPU memory to and from the cache",
        ["cuMemcpy, pinned", "ioctl (zero-copy)", "POSIX fed from pinned"],
        ("store (DtoH)", "load (HtoD)"),
        f"{args.size_mib} MiB blocks on {device}\nioctl store = "
        f"{ratios['ioctl_store_vs_cumemcpy_dtoh']}x cuMemcpy DtoH, load = "
        f"{ratios['ioctl_load_vs_cumemcpy_htod']}x HtoD",
        [f"IPC handle open + close per request: median {ipc['median_us']} µs, max "
         f"{ipc['max_us']} µs, {ipc['share_of_block_dtoh']:.1%} of one block's cuMemcpy DtoH. "
         f"Bytes checked after the round trip: {'ok' if bytes_ok else 'DIFFERENT'}."])
    return 0 if bytes_ok else 1


if __name__ == "__main__":
    sys.exit(main())
