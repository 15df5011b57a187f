#!/usr/bin/env python3
"""Cache hits through the mount against the best plain directory, as issue 18 sets the targets.

Each run measures, for every thread count (default 1, 8 and 64), max(32, threads) files of 32 MiB:

  store        llm-d's store sequence (tests/connectors.llmd_write's syscalls: open -> ENOENT,
               mkdir levels, open tmp O_WRONLY|O_CREAT|O_TRUNC, one writev, rename, close)
               into tmpfs and into the mount (DRAM tier), each after a 3 s pause, in
               alternating order between runs (see store_phases: this VM's fresh memory)
  llmd load    llm-d's read: open, lseek END, lseek SET, read loop of <= 8 MiB pieces into the
               caller's page-aligned buffer, close
  vllm load    vLLM FS tier's read (vllm/v1/kv_offload/tiering/fs/io.py): open O_RDONLY|O_DIRECT,
               one readv of the whole block into a page-aligned buffer, close
  for each load: tmpfs, the mount with the files in the DRAM tier, a directory on the disk
               that holds the NVMe tier with the page cache dropped (cold), and the mount after a
               bluecached restart with the page cache dropped (every file promoted from NVMe, its
               CRC32C checked): one restart per load workload, so neither finds the other's
               promotions in DRAM.

Before the loads, the bench waits for bluecached to write the stored files behind to NVMe (as
the plain directory's stores are synced): a hit is a read of a block stored a while ago.
Only the I/O is timed: source buffers are filled before the clock starts, read buffers zeroed
before it, and every file is compared byte for byte after it stops. Each run measures every
baseline in the same run, so a ratio never compares two different moments of the machine; the
report gives the median ratio of --runs runs and their range, and p50/p99 time to last byte of
one 32 MiB load (1 thread: what a request's TTFT pays per block).

    .venv/bin/python bench/hit_bench.py            # -> docs/benchmarks/hit.{json,md,png}
    .venv/bin/python bench/hit_bench.py --quick    # -> /tmp/bluecache-hit-bench-quick/

Needs root (mount, drop_caches).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import yaml

MiB = 1 << 20
PIECE = 8 * MiB          # llm-d reads in pieces of at most this
TARGETS = {"store": 0.8, "llmd": 0.9, "vllm": 0.9, "llmd_nvme": 1.0, "vllm_nvme": 1.0}


# -- the connectors' syscalls -----------------------------------------------------------------


def block_path(root: Path, i: int) -> str:
    # the llm-d layout's shape: <root>/<model>_r0/<hhh>/<hh>_g0/<hash>.bin
    h = f"{i * 2654435761 % (1 << 64):016x}{i:048x}"
    return str(root / "model_r0" / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin")


def llmd_store(path: str, src: memoryview, tag: str) -> None:
    try:
        os.close(os.open(path, os.O_RDONLY))
        raise RuntimeError(f"{path} exists before its store")
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}_{tag}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        if os.writev(fd, [src]) != len(src):
            raise RuntimeError(f"short write to {tmp}")
        os.rename(tmp, path)
    finally:
        os.close(fd)


def llmd_load(path: str, dst: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        done = 0
        while done < size:
            n = os.readv(fd, [dst[done:min(size, done + PIECE)]])
            if n <= 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


def vllm_load(path: str, dst: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return os.readv(fd, [dst])
    finally:
        os.close(fd)


# -- data ---------------------------------------------------------------------------------------


class Blocks:
    """`count` distinct blocks of `size` bytes in page-aligned buffers, and as many read
    buffers: a block's first and last 4 KiB carry its number, the rest a shared pattern."""

    def __init__(self, count: int, size: int):
        self.size = size
        base = harness.pattern("hit-bench", size)
        self.src = []
        for i in range(count):
            b = mmap.mmap(-1, size)
            b[:] = base
            stamp = f"block {i:08d} ".encode() * (4096 // 15)
            b[:len(stamp)] = stamp
            b[size - len(stamp):] = stamp
            self.src.append(b)
        self.dst = [mmap.mmap(-1, size) for _ in range(count)]

    def clear_reads(self) -> None:
        zeros = bytes(self.size)
        for b in self.dst:
            b[:] = zeros

    def check_reads(self, where: str) -> None:
        for i, (a, b) in enumerate(zip(self.src, self.dst, strict=True)):
            if a[:] != b[:]:
                raise RuntimeError(f"{where}: block {i} read back wrong")


def run_threads(threads: int, count: int, work) -> dict:
    """work(i) for i in range(count), spread over `threads` threads; wall time and each call's
    seconds."""
    each = [0.0] * count
    errors = []
    start = threading.Barrier(threads + 1)

    def worker(k: int) -> None:
        start.wait()
        for i in range(k, count, threads):
            t0 = time.perf_counter()
            try:
                work(i)
            except Exception as e:   # reported after the phase, with the block
                errors.append(f"block {i}: {e!r}")
                return
            each[i] = time.perf_counter() - t0

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return {"wall_s": wall, "each_s": each}


def store_phase(root: Path, blocks: Blocks, threads: int) -> dict:
    n = len(blocks.src)
    return run_threads(threads, n, lambda i: llmd_store(block_path(root, i),
                                                        memoryview(blocks.src[i]), f"t{i}"))


def load_phase(root: Path, blocks: Blocks, threads: int, how: str, where: str) -> dict:
    load = llmd_load if how == "llmd" else vllm_load
    blocks.clear_reads()

    def one(i: int) -> None:
        got = load(block_path(root, i), memoryview(blocks.dst[i]))
        if got != blocks.size:
            raise RuntimeError(f"read {got} of {blocks.size} bytes")

    r = run_threads(threads, len(blocks.src), one)
    blocks.check_reads(f"{how} load from {where}")
    return r


def mib_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / MiB / seconds, 1)


# -- one run ------------------------------------------------------------------------------------


class Mount:
    """bluecached + hostd in `work`, the cache mounted at work/mnt."""

    def __init__(self, work: Path, data_bytes: int, daemon_settings: dict, hostd_settings: dict):
        room = max(1 << 30, 2 * data_bytes)
        self.daemon = harness.Bluecached(work / "bc", **{
            "tiers.dram.size": f"{room >> 20}MiB", "tiers.nvme.size": f"{2 * room >> 20}MiB",
            "tiers.nvme.segment_size": "1GiB", **daemon_settings})
        self.mnt = work / "mnt"
        self.hostd = harness.Hostd(self.daemon, self.mnt, **hostd_settings)

    def start(self) -> Mount:
        self.daemon.start()
        self.hostd.start()
        return self

    def settle(self, timeout: float = 600) -> float:
        return self.daemon.settle(timeout)

    def make_resident(self, blocks: Blocks, tries: int = 4) -> int:
        """Reads every block (untimed) until all are in the DRAM tier, so that the DRAM phase
        measures DRAM hits: after the previous workload's NVMe phase they are on NVMe only
        (tiers.nvme.hit_path direct serves a first hit from the disk and leaves it there; the
        next open brings it in). Then, if it read any, once more by the kernel's own path:
        the first read of a page after it was filled costs ~1.5 ms more per 32 MiB, on tmpfs
        as much as here (ad hoc, 2-core AMD EPYC VM: 4.3-4.4 ms, then 2.6-2.8), and the
        tmpfs baseline of the second workload reads blocks read once before. Returns how many
        passes it took (0: all were resident)."""
        client = self.daemon.client()
        try:
            for passes in range(tries + 1):
                deadline = time.monotonic() + 60
                while (client.call("stats")["tiers"]["dram"]["objects"] < len(blocks.src)
                       and passes and time.monotonic() < deadline):
                    time.sleep(0.02)   # a promotion started by the last pass still streaming
                if client.call("stats")["tiers"]["dram"]["objects"] >= len(blocks.src):
                    if passes:
                        load_phase(self.mnt, blocks, 1, "vllm", "the mount (warm-up)")
                    return passes
                load_phase(self.mnt, blocks, 1, "vllm", "the mount (warm-up)")
        finally:
            client.close()
        raise RuntimeError(f"blocks not resident in DRAM after {tries} passes")

    def restart_daemon(self) -> None:
        """SIGTERM (dirty objects written behind, index checkpointed), start again: every
        object is on NVMe only. hostd reconnects by itself."""
        if self.daemon.stop(signal.SIGTERM, timeout=300) != 0:
            raise RuntimeError("bluecached did not stop cleanly:\n"
                               + self.daemon.log.read_text(errors="replace")[-3000:])
        self.daemon.start()
        deadline = time.monotonic() + 60
        while True:    # until hostd is through to the new daemon
            try:
                os.stat(self.mnt / "model_r0")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> list[str]:
        problems = []
        with contextlib.suppress(Exception):
            self.hostd.stop()
        with contextlib.suppress(Exception):
            self.daemon.stop(signal.SIGTERM, timeout=300)
        # hostd says so each time the bench restarts bluecached: expected here
        problems += (self.hostd.unexpected_log_lines(allowed=("lost bluecached",))
                     + self.daemon.unexpected_log_lines())
        harness.force_unmount(self.mnt)
        self.daemon.cleanup()
        return problems


MEMORY_SETTLE_S = 3.0   # > the guest's free page reporting delay (2 s): see store_phases


def store_phases(mount: Mount, shm: Path, blocks: Blocks, threads: int,
                 mount_first: bool) -> tuple[dict, dict]:
    """The llm-d store into tmpfs and into the mount, (tmpfs, mount). Both write fresh memory,
    and on this kind of VM whichever writes right after memory was freed gets the freed,
    still-mapped pages, while the other gets pages the guest already handed back to the host
    (free page reporting), several times slower to fault in: measured ad hoc, 8 writers of
    32 x 32 MiB after deleting the last round's files, the one storing second ran 0.15-0.31x
    the first with tmpfs first and 1.6-4.2x with the mount first. main() holds reporting off
    (harness.guest_memory_kept); as well, each store starts after MEMORY_SETTLE_S, and the
    order alternates between runs, for a machine where reporting cannot be held."""
    order = ("mount", "tmpfs") if mount_first else ("tmpfs", "mount")
    out = {}
    for where in order:
        time.sleep(MEMORY_SETTLE_S)
        out[where] = store_phase(mount.mnt if where == "mount" else shm, blocks, threads)
    return out["tmpfs"], out["mount"]


def one_run(threads_list: list[int], size: int, daemon_settings: dict,
            hostd_settings: dict, mount_first: bool = False, tmpfs: str = "/dev/shm",
            disk_dir: str = "/var/tmp") -> dict:
    out = {}
    for threads in threads_list:
        count = max(32, threads) if size >= 32 * MiB else max(8, threads)
        blocks = Blocks(count, size)
        shm = Path(tempfile.mkdtemp(prefix="bc-hit-", dir=tmpfs))
        disk = Path(tempfile.mkdtemp(prefix="bc-hit-", dir=disk_dir))
        mount = Mount(disk / "cache", count * size, daemon_settings, hostd_settings)
        nbytes = count * size
        point: dict = {"files": count, "file_mib": size // MiB}
        try:
            mount.start()
            point["store_order"] = "mount first" if mount_first else "tmpfs first"
            s_tmpfs, s_mount = store_phases(mount, shm, blocks, threads, mount_first)
            store_phase(disk / "plain", blocks, threads)
            os.sync()
            point["write_behind_wait_s"] = round(mount.settle(), 2)
            point["store"] = {"tmpfs": mib_s(nbytes, s_tmpfs["wall_s"]),
                              "bluecache": mib_s(nbytes, s_mount["wall_s"])}
            for how in ("llmd", "vllm"):
                tm = load_phase(shm, blocks, threads, how, "tmpfs")
                point[f"{how}_warmup_reads"] = mount.make_resident(blocks)
                point[f"{how}_quiet_wait_s"] = round(harness.wait_quiet(mount.daemon.proc.pid), 2)
                bc = load_phase(mount.mnt, blocks, threads, how, "the mount (DRAM)")
                harness.drop_caches()
                cold = load_phase(disk / "plain", blocks, threads, how, "a plain directory")
                mount.restart_daemon()
                harness.drop_caches()
                nv = load_phase(mount.mnt, blocks, threads, how, "the mount (NVMe)")
                point[how] = {"tmpfs": mib_s(nbytes, tm["wall_s"]),
                              "bluecache": mib_s(nbytes, bc["wall_s"])}
                point[f"{how}_nvme"] = {"plain_cold": mib_s(nbytes, cold["wall_s"]),
                                        "bluecache": mib_s(nbytes, nv["wall_s"])}
                if threads == 1:
                    point[f"{how}_ttlb_ms"] = {"tmpfs": [round(s * 1e3, 3) for s in tm["each_s"]],
                                               "bluecache": [round(s * 1e3, 3)
                                                             for s in bc["each_s"]]}
        finally:
            point["log_problems"] = mount.stop()
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
        for key, base in (("store", "tmpfs"), ("llmd", "tmpfs"), ("vllm", "tmpfs"),
                          ("llmd_nvme", "plain_cold"), ("vllm_nvme", "plain_cold")):
            point[key]["ratio"] = round(point[key]["bluecache"] / point[key][base], 3)
        print(f"  {threads} threads: " + ", ".join(f"{k} {point[k]['ratio']}x"
                                                  for k in TARGETS), flush=True)
        out[str(threads)] = point
    return out


# -- report -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(runs: list[dict], threads_list: list[int]) -> dict:
    summary = {}
    for threads in threads_list:
        row = {}
        for key, target in TARGETS.items():
            ratios = [r[str(threads)][key]["ratio"] for r in runs]
            row[key] = {"median": round(statistics.median(ratios), 3),
                        "min": min(ratios), "max": max(ratios), "target": target,
                        "met": statistics.median(ratios) >= target,
                        "bluecache_mib_s": statistics.median(
                            r[str(threads)][key]["bluecache"] for r in runs)}
        summary[str(threads)] = row
    ttlb = {}
    for how in ("llmd", "vllm"):
        key = f"{how}_ttlb_ms"
        if all(key in r.get("1", {}) for r in runs):
            for side in ("tmpfs", "bluecache"):
                ms = [v for r in runs for v in r["1"][key][side]]
                ttlb[f"{how}/{side}"] = {"p50": percentile(ms, 0.5), "p99": percentile(ms, 0.99),
                                         "n": len(ms)}
    return {"ratios": summary, "ttlb_ms": ttlb}


def write_report(results: dict, out_dir: Path, out_name: str = "hit") -> None:
    names = {"store": "store (llm-d) vs tmpfs", "llmd": "load, llm-d read() vs tmpfs",
             "vllm": "load, vLLM O_DIRECT readv vs tmpfs",
             "llmd_nvme": "NVMe-tier load, llm-d vs cold plain dir",
             "vllm_nvme": "NVMe-tier load, vLLM vs cold plain dir"}
    lines = harness.markdown_head("Cache hits through the mount (issue 18)", results,
                                  f"{results['runs']} runs; ratios are bluecache / the baseline "
                                  "measured in the same run: median [min-max].")
    threads = list(results["summary"]["ratios"])
    lines += ["| workload | target | " + " | ".join(f"{t} thr" for t in threads) + " |",
              "|---|---|" + "---|" * len(threads)]
    for key, name in names.items():
        cells = []
        for t in threads:
            c = results["summary"]["ratios"][t][key]
            cells.append(f"{'**' if c['met'] else ''}{c['median']}x{'**' if c['met'] else ''} "
                         f"[{c['min']}-{c['max']}], {c['bluecache_mib_s']:.0f} MiB/s")
        lines.append(f"| {name} | >= {TARGETS[key]}x | " + " | ".join(cells) + " |")
    lines += ["", "Bold: target met (median). MiB/s: bluecache's median.", ""]
    settings = [f"{who} {k}={v}" for who, given in (("bluecached", "daemon_settings"),
                                                    ("hostd", "hostd_settings"))
                for k, v in results.get(given, {}).items()]
    lines += [f"Settings: {', '.join(settings) if settings else 'the defaults'} (besides the "
              "bench's own tier sizes).", ""]
    lines += ["NVMe tier and the plain directory compared with it: "
              f"{results.get('disk', '/var/tmp')} ({results.get('disk_options', '?')}).", ""]
    if results.get("tmpfs", "/dev/shm") != "/dev/shm":
        lines += [f"tmpfs baseline: {results['tmpfs']} ({results.get('tmpfs_options', '?')}), "
                  "not /dev/shm.", ""]
    memory = results.get("guest_memory")
    if memory:
        lines += ["Guest memory (harness.guest_memory_kept): free page reporting "
                  f"{memory['page_reporting']}"
                  + (f", {memory['warmed_gib']} GiB touched and freed first"
                     if "warmed_gib" in memory else "") + ".", ""]
    if results["summary"]["ttlb_ms"]:
        lines += ["Time to last byte of one block, 1 thread (ms):", "",
                  "| load | p50 | p99 | samples |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['p50']} | {v['p99']} | {v['n']} |"
                  for k, v in results["summary"]["ttlb_ms"].items()]
        lines.append("")
    problems = [p for r in results["runs_raw"] for point in r.values()
                for p in point["log_problems"]]
    lines.append(f"Daemon log warnings/errors during the runs: {len(problems)}.")

    def plot(plt, path: Path) -> None:
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / len(threads)
        for k, t in enumerate(threads):
            cells = [results["summary"]["ratios"][t][key] for key in names]
            med = [c["median"] for c in cells]
            lo = [c["median"] - c["min"] for c in cells]
            hi = [c["max"] - c["median"] for c in cells]
            xs = [x + k * width for x in range(len(names))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=f"{t} threads")
        for x, key in enumerate(names):
            ax.hlines(TARGETS[key], x - 0.1, x + 0.8, colors="black", linestyles="dashed")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))],
                      [n.replace(" vs ", "\nvs ") for n in names.values()], fontsize=7)
        ax.set_ylabel("bluecache / baseline")
        ax.set_title("Cache hits (dashed: target; bars: median of runs, whiskers: range); "
                     + results["machine"]["cpu_model"][:40], fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    harness.write_results(out_dir, out_name, results, "\n".join(lines), plot)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 MiB files, 1 and 8 threads, 1 run")
    ap.add_argument("--runs", type=int, help="runs (default 3)")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tmpfs", default="/dev/shm",
                    help="the tmpfs baseline's directory (default /dev/shm, as distributions "
                         "mount it; e.g. a tmpfs mounted with huge=within_size to compare on "
                         "equal pages)")
    ap.add_argument("--disk", default="/var/tmp",
                    help="where the NVMe tier and the plain directory it is compared with go "
                         "(default /var/tmp); e.g. a btrfs, where NVMe hits are reflink clones "
                         "read by the kernel (tiers.nvme.hit_path auto)")
    ap.add_argument("--daemon", action="append", default=[], metavar="KEY=VALUE",
                    help="a bluecached setting for the run (repeatable)")
    ap.add_argument("--hostd", action="append", default=[], metavar="KEY=VALUE",
                    help="a hostd setting for the run (repeatable)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("hit_bench needs root (mount, drop_caches)", file=sys.stderr)
        return 2
    runs = args.runs or (1 if args.quick else 3)
    threads_list = args.threads or ([1, 8] if args.quick else [1, 8, 64])
    size = 8 * MiB if args.quick else 32 * MiB
    out_dir = args.out or (Path("/tmp/bluecache-hit-bench-quick") if args.quick
                           else harness.ROOT / "docs" / "benchmarks")
    # VALUE as written in the config file (YAML): `mount.passthrough=false` is a boolean
    daemon_settings = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.daemon)}
    hostd_settings = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.hostd)}
    results = harness.run_info("hit_bench")
    results.update(threads=threads_list, runs=runs, file_mib=size // MiB,
                   daemon_settings=daemon_settings, hostd_settings=hostd_settings,
                   tmpfs=args.tmpfs, tmpfs_options=harness.mount_options(args.tmpfs),
                   disk=args.disk, disk_options=harness.mount_options(args.disk))
    raw = []
    warm = min(8 * harness.GiB, harness.memory_available() // 2)
    with harness.guest_memory_kept(warm) as memory:
        results["guest_memory"] = memory
        for k in range(runs):
            print(f"run {k + 1} of {runs}", flush=True)
            raw.append(one_run(threads_list, size, daemon_settings, hostd_settings,
                               mount_first=k % 2 == 1, tmpfs=args.tmpfs, disk_dir=args.disk))
    results["runs_raw"] = raw
    results["summary"] = summarize(raw, threads_list)
    write_report(results, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
