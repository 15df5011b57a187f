"""Zero-copy ioctl vs the POSIX path vs tmpfs, for 32 MiB KV blocks, in one run.

    python bench/ioctl_bench.py [--blocks 24] [--size-mib 32] [--out-dir docs/benchmarks]

Starts bluecached + hostd (bench/harness.py) mounting a temp dir, then for each target
stores `--blocks` files and loads them back, from/into the same memfd-backed buffer:
  ioctl   hostd.zerocopy.store_from / load_into (STORE into a temp name + rename; LOAD)
  posix   the llm-d sequence through the mount: open tmp, one write, rename, close; read back
  tmpfs   the same POSIX sequence on /dev/shm (the "tmpfs direct" baseline)
Before each load phase the bench waits for bluecached's write-behind of the blocks just stored
(--no-settle: it does not), as bench/hit_bench.py does: a hit is a read of a block stored a
while ago. Each round runs the three targets in turn (the order rotating by round), and the
report gives medians over --rounds with the range of the per-round ratios. Guest memory is held
as in hit_bench (harness.guest_memory_kept): on a VM that hands freed memory back, a store of
fresh memory otherwise measures the hypervisor. Targets from the issues: ioctl store >= 2x the
POSIX store and >= 0.8x a tmpfs direct write (issue 18: LOAD >= 1.0x a tmpfs read).
Writes ioctl.json, ioctl.md and ioctl.png to --out-dir (docs/benchmarks by default).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import Bluecached, Hostd, MiB, force_unmount, pattern

from hostd.zerocopy import SharedBuffer, load_into, store_from


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds, each storing and loading every target (medians reported)")
    ap.add_argument("--out-dir", type=Path, default=harness.ROOT / "docs/benchmarks")
    ap.add_argument("--settle", action=argparse.BooleanOptionalAction, default=True,
                    help="before each load phase, wait until bluecached has written the "
                         "stored blocks behind to NVMe (as bench/hit_bench.py: a hit is a "
                         "read of a block stored a while ago); --no-settle loads at once, "
                         "against the write-behind of the burst just stored")
    ap.add_argument("--daemon", action="append", default=[], metavar="KEY=VALUE",
                    help="a bluecached setting for the run (repeatable)")
    args = ap.parse_args()
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="bcioctl-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bcioctl-", dir="/dev/shm"))
    dram = f"{max(2 * args.blocks * args.size_mib, 512)}MiB"
    daemon = Bluecached(work / "d", **{"tiers.dram.size": dram, "tiers.nvme.size": "8GiB",
                                       "tiers.nvme.segment_size": "1GiB",
                                       **dict(kv.split("=", 1) for kv in args.daemon)})
    hostd = Hostd(daemon, work / "mnt")
    out = harness.run_info("ioctl_bench", device="no GPU (embedded mode, loopback engine: "
                                                 "memfd + memcpy)")
    started = time.time()
    rounds: dict[str, dict[str, list[float]]] = {}   # target -> phase -> MiB/s per round
    warm = min(8 * harness.GiB, harness.memory_available() // 2)
    with contextlib.ExitStack() as held:
        out["guest_memory"] = held.enter_context(harness.guest_memory_kept(warm))
        held.callback(shutil.rmtree, shm, ignore_errors=True)
        held.callback(shutil.rmtree, work, ignore_errors=True)
        held.callback(force_unmount, work / "mnt")
        held.callback(daemon.stop)
        held.callback(hostd.stop)   # whatever failed: callbacks run last-first
        daemon.start()
        hostd.start()
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
        for where in (w for _, _, w in targets.values()):
            where.mkdir()
        names = list(targets)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                store, load, where = targets[name]
                paths = [str(where / f"r{r}_b{i}.bin") for i in range(args.blocks)]
                stored = timed(store, paths)
                if args.settle:
                    daemon.settle()
                loaded = timed(load, paths)
                for p in paths:
                    os.unlink(p)
                row = rounds.setdefault(name, {"store_mib_s": [], "load_mib_s": []})
                row["store_mib_s"].append(round(total_mib / stored, 1))
                row["load_mib_s"].append(round(total_mib / loaded, 1))
                print(f"round {r + 1} {name:6} store {row['store_mib_s'][-1]:8.1f} MiB/s   "
                      f"load {row['load_mib_s'][-1]:8.1f} MiB/s", flush=True)
        assert bytes(view[:4096]) == pattern("bench", 4096)
        view.release()
        buf.close()
    results = {name: {phase: round(statistics.median(v), 1) for phase, v in row.items()}
               for name, row in rounds.items()}

    def ratio(a: str, b: str, phase: str) -> dict:
        per_round = [x / y for x, y in zip(rounds[a][phase], rounds[b][phase], strict=True)]
        return {"median": round(statistics.median(per_round), 2),
                "min": round(min(per_round), 2), "max": round(max(per_round), 2)}

    spread = {"ioctl_store_vs_posix_store": ratio("ioctl", "posix", "store_mib_s"),
              "ioctl_store_vs_tmpfs_write": ratio("ioctl", "tmpfs", "store_mib_s"),
              "ioctl_load_vs_posix_load": ratio("ioctl", "posix", "load_mib_s"),
              "ioctl_load_vs_tmpfs_read": ratio("ioctl", "tmpfs", "load_mib_s")}
    ratios = {k: v["median"] for k, v in spread.items()}
    targets_met = {"ioctl store >= 2x POSIX store": ratios["ioctl_store_vs_posix_store"] >= 2,
                   "ioctl store >= 0.8x tmpfs write": ratios["ioctl_store_vs_tmpfs_write"] >= 0.8,
                   "ioctl load >= 1.0x tmpfs read": ratios["ioctl_load_vs_tmpfs_read"] >= 1.0}
    out.update({"block_mib": args.size_mib, "blocks": args.blocks, "rounds": args.rounds,
                "settled_before_loads": args.settle, "daemon_settings": args.daemon,
                "results_mib_s": results, "rounds_mib_s": rounds, "ratios": ratios,
                "ratio_ranges": spread, "targets_met": targets_met,
                "seconds": round(time.time() - started, 1)})
    print(json.dumps({"ratios": ratios, "targets_met": targets_met}, indent=2))
    harness.write_block_results(
        args.out_dir, "ioctl", out, "Zero-copy ioctl vs the POSIX path vs tmpfs",
        ["ioctl (zero-copy)", "POSIX via mount", "tmpfs direct"], ("store", "load"),
        f"{args.size_mib} MiB blocks, {os.cpu_count()} cores, loopback engine\n"
        f"ioctl store = {ratios['ioctl_store_vs_posix_store']}x POSIX, "
        f"{ratios['ioctl_store_vs_tmpfs_write']}x tmpfs",
        notes=[f"Per-round ratios, median [min-max] over {args.rounds} rounds:", ""]
        + [f"- {k.replace('_', ' ')}: {v['median']}x [{v['min']}-{v['max']}]"
           for k, v in spread.items()]
        + ["", f"Guest memory: {out['guest_memory']}."], aggregate="median of")
    return 0


if __name__ == "__main__":
    sys.exit(main())
