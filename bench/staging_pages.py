#!/usr/bin/env python3
"""O_DIRECT reads into hostd's staging memory on 4 KiB pages vs 2 MiB pages (mount.huge_pages,
bluecached/huge_pages.py), against a plain process reading the same kind of file.

An NVMe hit is read by bluecached with O_DIRECT straight into a staging slot, 4 MiB (or 1 MiB)
at a time. Each run writes --files files of 32 MiB into a directory on the disk under --dir
(synced), then reads every file three ways, in an order that rotates from file to file:

  memfd 4K    8 reads of 4 MiB, one after the other, into a fresh shared memfd mapping
              (bluecached.shm.SharedRegion as hostd made it before: 4 KiB pages)
  memfd 2M    the same into a fresh SharedRegion(huge=True) (2 MiB pages where the kernel's
              shmem policy allows; this bench sets it to advise and puts it back after)
  plain       one preadv of 32 MiB into a process's anonymous buffer (vLLM's read of a
              plain file, the baseline of bench/hit_bench.py's NVMe cells)

Each file is read once per way (a different file each time: nothing comes from a cache the
guest controls; the page cache is not used by O_DIRECT). Only the reads are timed: buffers are
allocated and faulted in before the clock, and each read is checked against the file's
pattern after it. Reports ms per 32 MiB: median per run, then the median of runs and range.

    .venv/bin/python bench/staging_pages.py     # -> docs/benchmarks/staging-pages.*

Needs root (the shmem policy).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

from bluecached import huge_pages
from bluecached.shm import SharedRegion

MiB = 1 << 20
FILE = 32 * MiB
PIECE = 4 * MiB
WAYS = ("memfd 4K", "memfd 2M", "plain")


def write_files(where: Path, count: int, run: int) -> list[tuple[Path, bytes]]:
    files = []
    for i in range(count):
        data = harness.pattern(f"staging-{run}-{i}", FILE)
        path = where / f"block-{i}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        files.append((path, data))
    return files


def timed_read(path: Path, dst: memoryview, piece: int) -> float:
    """Seconds to read the file into `dst` with O_DIRECT, `piece` bytes per read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        started = time.perf_counter()
        for off in range(0, FILE, piece):
            if os.preadv(fd, [dst[off:off + piece]], off) != piece:
                raise RuntimeError(f"short read of {path}")
        return time.perf_counter() - started
    finally:
        os.close(fd)


def one_run(where: Path, count: int, run: int) -> dict[str, list[float]]:
    files = write_files(where, 3 * count, run)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(count):
        for k in range(3):
            way = WAYS[(i + k) % 3]
            path, data = files[3 * i + k]
            if way == "plain":
                buf = mmap.mmap(-1, FILE)
                buf.write(b"\0" * FILE)   # faulted in before the clock
                view = memoryview(buf)
                times[way].append(timed_read(path, view, FILE))
            else:
                region = SharedRegion(FILE, "bench-staging", huge=way == "memfd 2M")
                if way == "memfd 4K":
                    region.view[:] = b"\0" * FILE   # faulted in, as the daemon's MAP_POPULATE
                view = region.view
                times[way].append(timed_read(path, view, PIECE))
            if view != data:
                raise RuntimeError(f"{way}: {path} read back wrong")
            view.release()
            (buf if way == "plain" else region).close()
    for path, _ in files:
        path.unlink()
    return {way: [round(t * 1e3, 3) for t in ts] for way, ts in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--files", type=int, default=8, help="files per way per run")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--out", type=Path, default=harness.ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("staging_pages needs root (the shmem policy)", file=sys.stderr)
        return 2
    policy_was = huge_pages.shmem_policy()
    if not huge_pages.allow_advised():
        print(f"the kernel gives no 2 MiB shmem pages here (policy {policy_was})",
              file=sys.stderr)
        return 1
    results = harness.run_info("staging_pages", disk_dir=str(args.dir))
    results.update(runs=args.runs, files=args.files, file_mib=FILE // MiB,
                   piece_mib=PIECE // MiB, shmem_policy_was=policy_was, runs_raw=[])
    try:
        with tempfile.TemporaryDirectory(prefix="bc-staging-", dir=args.dir) as where:
            for run in range(args.runs):
                raw = one_run(Path(where), args.files, run)
                results["runs_raw"].append(raw)
                print(f"run {run + 1}: " + ", ".join(
                    f"{way} {statistics.median(ts):.2f} ms" for way, ts in raw.items()),
                    flush=True)
    finally:
        if policy_was == "never":
            huge_pages.SHMEM_ENABLED.write_text("never\n")
    write_report(results, args.out)
    return 0


def write_report(results: dict, out_dir: Path) -> None:
    medians = {way: [statistics.median(r[way]) for r in results["runs_raw"]] for way in WAYS}
    summary = {way: {"median_ms": round(statistics.median(m), 2), "min_ms": round(min(m), 2),
                     "max_ms": round(max(m), 2)} for way, m in medians.items()}
    plain = summary["plain"]["median_ms"]
    results["summary"] = summary
    lines = harness.markdown_head(
        "O_DIRECT reads into staging memory: 4 KiB vs 2 MiB pages", results,
        f"{results['runs']} runs x {results['files']} files of 32 MiB per way; ms per file: "
        "median of the runs' medians [range of the runs' medians].")
    lines += ["| read | ms per 32 MiB | vs the plain read |", "|---|---|---|"]
    for way, s in summary.items():
        lines.append(f"| {way} | {s['median_ms']} [{s['min_ms']}-{s['max_ms']}] | "
                     f"{plain / s['median_ms']:.2f}x |")
    lines += ["", "memfd 4K / memfd 2M: 8 x 4 MiB O_DIRECT reads into a shared memfd mapping, "
              "as bluecached reads an NVMe hit into hostd's staging; plain: one 32 MiB "
              "O_DIRECT preadv into a process's buffer. `vs the plain read`: plain's time / "
              "this one's (above 1: faster).",
              f"Kernel shmem huge page policy before the run: {results['shmem_policy_was']} "
              "(set to advise for it, put back after).", ""]

    def plot(plt, path):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for x, way in enumerate(WAYS):
            values = [t for r in results["runs_raw"] for t in r[way]]
            ax.scatter([x] * len(values), values, alpha=0.5)
            ax.hlines(summary[way]["median_ms"], x - 0.3, x + 0.3)
        ax.set_xticks(range(len(WAYS)), WAYS)
        ax.set_ylabel("ms per 32 MiB O_DIRECT read")
        ax.set_ylim(bottom=0)
        ax.set_title("Staging memory pages (each dot one file; line: median)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)

    harness.write_results(out_dir, "staging-pages", results, "\n".join(lines), plot)


if __name__ == "__main__":
    sys.exit(main())
