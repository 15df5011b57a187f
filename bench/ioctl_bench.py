"""Zero-copy ioctl vs the POSIX path vs tmpfs, for 32 MiB KV blocks, in one run.

    python bench/ioctl_bench.py [--blocks 24] [--size-mib 32] [--out-dir docs/benchmarks]

Starts bluecached + hostd (as tests/support.py does) mounting a temp dir, then for each target
stores `--blocks` files and loads them back, from/into the same memfd-backed buffer:
  ioctl   hostd.zerocopy.store_from / load_into (STORE into a temp name + rename; LOAD)
  posix   the llm-d sequence through the mount: open tmp, one write, rename, close; read back
  tmpfs   the same POSIX sequence on /dev/shm (the "tmpfs direct" baseline)
Targets from the issue: ioctl store >= 2x the POSIX store, and >= 0.8x a tmpfs direct write.
Writes docs/benchmarks/ioctl.json and ioctl.png.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hostd.zerocopy import SharedBuffer, load_into, store_from  # noqa: E402
from support import DaemonProcess, HostdProcess, force_unmount, pattern  # noqa: E402

MiB = 1 << 20


def posix_store(path: str, view: memoryview) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.rename(tmp, path)
    finally:
        os.close(fd)


def posix_load(path: str, view: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.readv(fd, [view[done:]])
            if not n:
                break
            done += n
        return done
    finally:
        os.close(fd)


def timed(fn, paths, *args) -> float:
    start = time.perf_counter()
    for p in paths:
        fn(p, *args)
    return time.perf_counter() - start


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="repeat each phase, keep the best")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs/benchmarks")
    args = ap.parse_args()
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="bcioctl-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bcioctl-", dir="/dev/shm"))
    dram = f"{max(2 * args.blocks * args.size_mib, 512)}MiB"
    daemon = DaemonProcess(work / "d", **{"tiers.dram.size": dram, "tiers.nvme.size": "8GiB",
                                          "tiers.nvme.segment_size": "1GiB"})
    started = time.time()
    results: dict[str, dict[str, float]] = {}
    try:
        daemon.start()
        hostd = HostdProcess(daemon, work / "mnt").start()
        mnt = work / "mnt"
        buf = SharedBuffer(size)
        buf.view()[:] = pattern("bench", size)
        view = buf.view()
        targets = {
            "ioctl": (lambda p: store_from(p, buf), lambda p: load_into(p, buf), mnt / "ioctl"),
            "posix": (lambda p: posix_store(p, view), lambda p: posix_load(p, view),
                      mnt / "posix"),
            "tmpfs": (lambda p: posix_store(p, view), lambda p: posix_load(p, view),
                      shm / "tmpfs"),
        }
        total_mib = args.blocks * args.size_mib
        for name, (store, load, where) in targets.items():
            where.mkdir()
            best_store = best_load = float("inf")
            for r in range(args.rounds):
                paths = [str(where / f"r{r}_b{i}.bin") for i in range(args.blocks)]
                best_store = min(best_store, timed(store, paths))
                best_load = min(best_load, timed(load, paths))
                for p in paths:
                    os.unlink(p)
            results[name] = {"store_mib_s": round(total_mib / best_store, 1),
                             "load_mib_s": round(total_mib / best_load, 1)}
            print(f"{name:6} store {results[name]['store_mib_s']:8.1f} MiB/s   "
                  f"load {results[name]['load_mib_s']:8.1f} MiB/s", flush=True)
        assert bytes(view[:4096]) == pattern("bench", 4096)
        view.release()
        buf.close()
        hostd.stop()
    finally:
        daemon.stop()
        force_unmount(work / "mnt")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    ratios = {
        "ioctl_store_vs_posix_store": round(results["ioctl"]["store_mib_s"]
                                            / results["posix"]["store_mib_s"], 2),
        "ioctl_store_vs_tmpfs_write": round(results["ioctl"]["store_mib_s"]
                                            / results["tmpfs"]["store_mib_s"], 2),
        "ioctl_load_vs_posix_load": round(results["ioctl"]["load_mib_s"]
                                          / results["posix"]["load_mib_s"], 2),
        "ioctl_load_vs_tmpfs_read": round(results["ioctl"]["load_mib_s"]
                                          / results["tmpfs"]["load_mib_s"], 2),
    }
    targets_met = {"ioctl store >= 2x POSIX store": ratios["ioctl_store_vs_posix_store"] >= 2,
                   "ioctl store >= 0.8x tmpfs write": ratios["ioctl_store_vs_tmpfs_write"] >= 0.8}
    out = {
        "benchmark": "ioctl_bench", "block_mib": args.size_mib, "blocks": args.blocks,
        "rounds": args.rounds, "results_mib_s": results, "ratios": ratios,
        "targets_met": targets_met, "seconds": round(time.time() - started, 1),
        "machine": {"platform": platform.platform(), "cpu": cpu_model(),
                    "cores": os.cpu_count(), "python": platform.python_version(),
                    "device": "no GPU (embedded mode, loopback engine: memfd + memcpy)"},
        "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "ioctl.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"ratios": ratios, "targets_met": targets_met}, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    for i, phase in enumerate(("store_mib_s", "load_mib_s")):
        vals = [results[n][phase] for n in names]
        bars = ax.bar([x + i * 0.38 for x in range(len(names))], vals, 0.38,
                      label=phase.split("_")[0])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([x + 0.19 for x in range(len(names))],
                  ["ioctl (zero-copy)", "POSIX via mount", "tmpfs direct"])
    ax.set_ylabel("MiB/s")
    ax.set_title(f"{args.size_mib} MiB blocks, {os.cpu_count()} cores, loopback engine\n"
                 f"ioctl store = {ratios['ioctl_store_vs_posix_store']}x POSIX, "
                 f"{ratios['ioctl_store_vs_tmpfs_write']}x tmpfs", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out_dir / "ioctl.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
