"""Index rebuild at daemon start: Journal.load() plus the NVMe free-space rebuild.

Writes N FILE records of 32 MiB objects (half folded into a snapshot, half left as journal
appends), then times loading them back and rebuilding the extent allocator from them.

    python bench/index_rebuild.py --objects 100000 --out docs/benchmarks/index_rebuild.json
        # and index_rebuild.md beside it
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import harness

from bluecached.tiers.journal import Journal
from bluecached.tiers.nvme import Extent, SegmentStore

OBJECT_SIZE = 32 << 20
SEGMENT_SIZE = 1 << 30
CHUNKS = OBJECT_SIZE >> 20


def file_record(ino: int, extent: Extent) -> tuple:
    # the shape of index.file_record: tag, ino, parent, name, mode, uid, gid, a/m/ctime, size,
    # extent offset, extent length, one CRC32C per 1 MiB chunk
    now = 1_700_000_000_000_000_000 + ino
    name = os.urandom(32).hex().encode()
    return ("F", ino, 1, name, 0o100644, 1000, 1000, now, now, now, OBJECT_SIZE,
            extent.offset, extent.length, os.urandom(4 * CHUNKS))


def run(objects: int, work: Path) -> dict:
    capacity = objects * OBJECT_SIZE
    store = SegmentStore(work / "nvme", capacity, SEGMENT_SIZE, o_direct="off")
    store.capacity = store.span   # nothing is written: the layout alone, of any size
    records = [file_record(ino, store.allocate(OBJECT_SIZE)) for ino in range(2, objects + 2)]
    store.close()

    journal = Journal(work / "nvme")
    journal.load()
    half = objects // 2
    journal.append_many(records[:half])
    journal.checkpoint(records[:half])
    for i in range(half, objects, 1000):
        journal.append_many(records[i:i + 1000])
    journal.sync()
    journal.close()
    del records

    t0 = time.perf_counter()
    journal = Journal(work / "nvme")
    loaded = journal.load()
    t1 = time.perf_counter()
    store = SegmentStore(work / "nvme", capacity, SEGMENT_SIZE, o_direct="off")
    store.rebuild([Extent(r[11], r[12]) for r in loaded])
    t2 = time.perf_counter()
    journal.close()
    store.close()
    assert len(loaded) == objects and store.used_bytes == capacity
    return {
        "objects": objects,
        "load_s": round(t1 - t0, 4),
        "rebuild_s": round(t2 - t1, 4),
        "total_s": round(t2 - t0, 4),
        "snapshot_bytes": (work / "nvme" / "index.snap").stat().st_size,
    }


def markdown(out: dict) -> str:
    return "\n".join(harness.markdown_head(
        "Index rebuild at daemon start", out,
        f"{out['objects']} FILE records of 32 MiB objects, half in a snapshot, half in the "
        "journal.") + [
        "| Journal.load | SegmentStore.rebuild | total | snapshot |", "|---|---|---|---|",
        f"| {out['load_s']} s | {out['rebuild_s']} s | {out['total_s']} s "
        f"| {out['snapshot_bytes'] / harness.MiB:.1f} MiB |"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--out", type=Path,
                    default=harness.ROOT / "docs/benchmarks/index_rebuild.json",
                    help="the JSON; the Markdown goes beside it (.md)")
    ap.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    out = harness.run_info("index_rebuild")
    if args.dir:
        if (args.dir / "nvme").exists():
            ap.error(f"{args.dir / 'nvme'} exists: give a fresh --dir")
        args.dir.mkdir(parents=True, exist_ok=True)
        out.update(run(args.objects, args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
            out.update(run(args.objects, Path(tmp)))
    print({k: out[k] for k in ("objects", "load_s", "rebuild_s", "total_s")})
    harness.write_results(args.out.parent, args.out.stem, out, markdown(out))


if __name__ == "__main__":
    sys.exit(main())
