"""The parts of a zero-copy STORE or LOAD of CUDA memory, timed apart on the device.

    python bench/gpu_parts.py [--size-mib 32] [--repeats 10] [--out-dir DIR] [--simulator]

gpu_bench.py times the whole ioctl; this says where a block's time goes, with bluecached's own
code (bluecached/dma/cuda.py, bluecached/tiers/dram.py) in this one process: one device buffer
(cuMemAlloc) and the DRAM tier's chunks (1 MiB windows of an object's memfd). Each part runs
`--repeats` times under each shmem huge-page policy the kernel offers of `never` and
`within_size` (what bluecached sets for the DRAM tier), on fresh memory each time where the
part is about fresh memory. Parts, per block:

  populate        populated_memfd: what map_ahead pays for a spare (fallocate + MAP_POPULATE)
  register        cuMemHostRegister of each window of a populated spare (page-locking)
  unregister      cuMemHostUnregister of each
  register_whole  one registration of one mapping of the whole populated memfd
  dtoh_pinned     CudaContext.device_to_host into registered windows (the copy alone)
  dtoh_on_path    the same into a populated spare not registered yet (registration on the
                  request's path, as a spare mapped before CUDA was in use gets)
  dtoh_fresh      the same into windows of a memfd with no pages yet (faults + registration)
  dtoh_pageable   into populated windows left unregistered (the driver stages them)
  dtoh_whole      one cuMemcpyDtoHAsync into the registered whole mapping (the ceiling)
  htod_pinned     CudaContext.host_to_device from registered windows
  cumemcpy_dtoh   cuMemcpyDtoH into cuMemAllocHost memory (gpu_bench's baseline)

Results in microseconds (median, min, max) to <out-dir>/gpu-parts.json and on stdout. The
numbers with --simulator (tests/cuda_sim.py: copies by the CPU) only prove the script runs.
"""

import argparse
import contextlib
import ctypes
import json
import mmap
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

from bluecached.dma import cuda as bc_cuda
from bluecached.dma.cuda import _address
from bluecached.huge_pages import SHMEM_ENABLED, shmem_policy
from bluecached.tiers.dram import CHUNK_SIZE, Memfd, populated_memfd

sys.path.append(str(harness.ROOT / "tests"))
import cuda_sim  # noqa: E402  (test tooling, found by path: it never ships)


class Parts:
    def __init__(self, ctx: bc_cuda.CudaContext, size: int):
        self.ctx, self.cu, self.size = ctx, ctx.cu, size
        self.count = size // CHUNK_SIZE
        ctx._current()
        self.dev = ctx._check(self.cu.cuMemAlloc(size), "cuMemAlloc")
        self.host = ctx._check(self.cu.cuMemAllocHost(size), "cuMemAllocHost")
        ctypes.memset(self.host, 0x5A, size)
        ctx._check(self.cu.cuMemcpyHtoD(self.dev, self.host, size), "cuMemcpyHtoD")

    def close(self) -> None:
        self.ctx._current()
        self.cu.cuMemFree(self.dev)
        self.cu.cuMemFreeHost(self.host)

    # -- helpers: each returns seconds of the timed part only ----------------------------------

    def spare(self) -> Memfd:
        return populated_memfd(self.count)

    def windows(self, memfd: Memfd) -> list:
        return [memfd.ahead[i] for i in range(self.count)]

    def register(self, chunks) -> float:
        t = time.perf_counter()
        for c in chunks:
            self.ctx._pin(c)
        return time.perf_counter() - t

    def unregister(self, chunks) -> float:
        t = time.perf_counter()
        for c in chunks:
            self.ctx.unpin(c)
        return time.perf_counter() - t

    def copy(self, chunks, to_host: bool = True) -> float:
        t = time.perf_counter()
        if to_host:
            self.ctx.device_to_host(int(self.dev), chunks)
        else:
            self.ctx.host_to_device(chunks, int(self.dev))
        return time.perf_counter() - t

    # -- the parts ------------------------------------------------------------------------------

    def populate(self) -> float:
        t = time.perf_counter()
        memfd = self.spare()
        took = time.perf_counter() - t
        memfd.close()
        return took

    def register_part(self, unregister: bool = False) -> float:
        memfd = self.spare()
        chunks = self.windows(memfd)
        took = self.register(chunks)
        undo = self.unregister(chunks)
        memfd.close()
        return undo if unregister else took

    @contextlib.contextmanager
    def whole(self):
        """One mapping of a whole populated spare, and the seconds registering it took."""
        memfd = self.spare()
        whole = mmap.mmap(memfd.fd, self.size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
        address = _address(whole)
        t = time.perf_counter()
        self.ctx._check(self.cu.cuMemHostRegister(address, self.size,
                                                  self.cu.CU_MEMHOSTREGISTER_PORTABLE),
                        "cuMemHostRegister")
        try:
            yield address, time.perf_counter() - t
        finally:
            self.cu.cuMemHostUnregister(address)
            whole.close()
            memfd.close()

    def register_whole(self) -> float:
        with self.whole() as (_, took):
            return took

    def dtoh(self, how: str) -> float:
        if how == "fresh":
            memfd = Memfd(self.size)
            chunks = [memfd.window(i) for i in range(self.count)]
        else:
            memfd = self.spare()
            chunks = self.windows(memfd)
        if how == "pinned":
            self.register(chunks)
        failed, self.ctx._pin_failed = self.ctx._pin_failed, how == "pageable"
        try:
            took = self.copy(chunks)
        finally:
            self.ctx._pin_failed = failed
        self.unregister(chunks)
        for c in chunks:
            c.close()
        memfd.ahead.clear()
        memfd.close()
        return took

    def htod_pinned(self) -> float:
        memfd = self.spare()
        chunks = self.windows(memfd)
        self.register(chunks)
        took = self.copy(chunks, to_host=False)
        self.unregister(chunks)
        memfd.close()
        return took

    def dtoh_whole(self) -> float:
        with self.whole() as (address, _):
            stream = self.ctx._take_stream()
            t = time.perf_counter()
            self.ctx._check(self.cu.cuMemcpyDtoHAsync(address, self.dev, self.size, stream),
                            "cuMemcpyDtoHAsync")
            self.ctx._check(self.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            took = time.perf_counter() - t
            self.ctx._give_stream(stream)
        return took

    def cumemcpy_dtoh(self) -> float:
        t = time.perf_counter()
        self.ctx._check(self.cu.cuMemcpyDtoH(self.host, self.dev, self.size), "cuMemcpyDtoH")
        return time.perf_counter() - t


PARTS = {
    "populate": Parts.populate,
    "register": Parts.register_part,
    "unregister": lambda p: p.register_part(unregister=True),
    "register_whole": Parts.register_whole,
    "dtoh_pinned": lambda p: p.dtoh("pinned"),
    "dtoh_on_path": lambda p: p.dtoh("on_path"),
    "dtoh_fresh": lambda p: p.dtoh("fresh"),
    "dtoh_pageable": lambda p: p.dtoh("pageable"),
    "dtoh_whole": Parts.dtoh_whole,
    "htod_pinned": Parts.htod_pinned,
    "cumemcpy_dtoh": Parts.cumemcpy_dtoh,
}


def set_policy(policy: str) -> bool:
    try:
        SHMEM_ENABLED.write_text(policy)
    except OSError:
        return False
    return shmem_policy() == policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--simulator", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bcgpu-parts-"))
    try:
        driver, kind = cuda_sim.cuda_driver(work, "simulator" if args.simulator else "gpu")
    except cuda_sim.Unavailable as e:
        print(f"gpu_parts: {e} (--simulator runs it without one)", file=sys.stderr)
        return 2
    ctx = bc_cuda.CudaContext(0)
    parts = Parts(ctx, args.size_mib << 20)
    before = shmem_policy()
    results: dict[str, dict] = {}
    try:
        for policy in ("within_size", "never"):
            if not set_policy(policy):
                print(f"gpu_parts: cannot set the shmem policy {policy}: skipped")
                continue
            for name, part in PARTS.items():
                part(parts)   # a warm-up round, not counted
                times = sorted(part(parts) * 1e6 for _ in range(args.repeats))
                row = {"median_us": round(statistics.median(times), 1),
                       "min_us": round(times[0], 1), "max_us": round(times[-1], 1)}
                results.setdefault(policy, {})[name] = row
                print(f"{policy:12} {name:15} median {row['median_us']:9.1f} us  "
                      f"[{row['min_us']:.1f}-{row['max_us']:.1f}]", flush=True)
    finally:
        parts.close()
        if before:
            set_policy(before)
    out = harness.run_info("gpu_parts")
    out.update({"simulated": kind != "gpu", "size_mib": args.size_mib,
                "repeats": args.repeats, "parts_us": results})
    out_dir = args.out_dir or work
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu-parts.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"results in {out_dir / 'gpu-parts.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
