"""Quick A/B runs through the mount: rounds of llm-d stores (and loads) with CPU accounting.

    python bench/mount_ab.py [--threads 8] [--files 32] [--rounds 5] [--load]
                             [--hostd mount.reader_thread=false] [--daemon tiers.dram.size=3GiB]

Starts bluecached + hostd as bench/mount_bench.py does (3 GiB DRAM, NVMe tier under a temp dir
in /var/tmp), then per round: every thread stores its 32 MiB files with the llm-d sequence,
(with --load, reads them back and checks every byte), deletes them and waits for write-behind.
Per round it prints MiB/s, CPU seconds per GiB of hostd and of bluecached, the cores each of
their threads used during the store, and how busy the whole machine was. The first round is a
warm-up (fresh DRAM-tier memory); compare the others. For A/B comparisons run it alternately
from two checkouts (or with a setting flipped); mount_bench.py is the full, recorded benchmark.
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import harness
import mount_bench as mb
import yaml
from harness import Hostd, MiB

BLOCK = 32 * MiB


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cores(after: dict, before: dict, seconds: float) -> list[float]:
    used = (after[t] - before.get(t, 0.0) for t in after)
    return sorted((round(u / seconds, 2) for u in used if u > 0.01), reverse=True)


def setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if not key or not _:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)   # as the config file would read it: 4, true, 3GiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--files", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load", action="store_true", help="read every round back and check it")
    ap.add_argument("--hostd", type=setting, action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--daemon", type=setting, action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bcab-", dir="/var/tmp"))
    mnt = work / "mnt"
    mnt.mkdir()
    settings = {"tiers.dram.size": "3GiB", "tiers.nvme.path": str(work / "nvme"),
                "tiers.nvme.size": "4GiB", "tiers.nvme.segment_size": "1GiB",
                **dict(args.daemon)}
    bc = mb.Bluecache(work / "bc", mnt, settings)
    try:
        bc.daemon.start()
        bc.hostd = Hostd(bc.daemon, mnt, **dict(args.hostd)).start()
        base = os.urandom(BLOCK)
        gib = args.files * BLOCK / (1 << 30)
        print(f"{args.threads} threads, {args.files} x 32 MiB per round; hostd "
              f"{dict(args.hostd) or 'defaults'}, bluecached {dict(args.daemon) or 'defaults'}")
        for r in range(args.rounds):
            data = mb.Dataset(args.files, BLOCK, r * 1000, base)
            hostd, daemon = bc.pids["hostd"], bc.pids["bluecached"]
            h0, d0, m0 = thread_cpu(hostd), thread_cpu(daemon), harness.system_busy()
            store = mb.store_phase(mnt, data, args.threads)
            h1, d1, m1 = thread_cpu(hostd), thread_cpu(daemon), harness.system_busy()
            seconds = store["seconds"]
            line = (f"round {r}{' (warm-up)' if r == 0 else ''}: store "
                    f"{mb.mib_s(args.files * BLOCK, seconds):7.0f} MiB/s, CPU-s/GiB hostd "
                    f"{(sum(h1.values()) - sum(h0.values())) / gib:.3f} bluecached "
                    f"{(sum(d1.values()) - sum(d0.values())) / gib:.3f}; cores per thread "
                    f"hostd {cores(h1, h0, seconds)} bluecached {cores(d1, d0, seconds)}; "
                    f"machine busy {(m1[0] - m0[0]) / max(1, m1[1] - m0[1]):.0%}")
            if args.load:
                load = mb.load_phase(mnt, data, args.threads)
                verified = data.verify_all()
                if verified["mismatches"]:
                    raise SystemExit(f"round {r}: wrong bytes read back: {verified['mismatches']}")
                line += (f"; load {mb.mib_s(args.files * BLOCK, load['seconds']):7.0f} MiB/s "
                         f"({verified['files_verified']} files checked)")
            print(line, flush=True)
            for name in data.names:
                os.unlink(mnt / name)
            bc.wait_written_behind()
            data.close()
    finally:
        bc.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
