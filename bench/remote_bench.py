#!/usr/bin/env python3
"""The remote (S3) tier through bluecached against the plain S3 client, on a real Ceph radosgw.

One run starts a single-node Ceph cluster (tests/ceph_cluster.py: mon, mgr, memstore OSD,
radosgw on loopback) and two complete embedded instances A and B (bluecached + hostd, each its
own state dir and mount) sharing one bucket, then measures in the same run:

  per object (--objects, 32 MiB each, interleaved, medians)
    raw_put          boto3 put_object of the bytes (one PUT, bytes in memory), boto3's defaults:
                     on plain http that signs the payload (a SHA-256 of the body on both ends)
    raw_put_unsigned the same with payload signing off, as bluecached uploads by default
                     (remote.sign_payload: false): the same work on the wire
    store_upload     bluecached on A: create + write + release through the protocol, until A's
                     remote tier reports the upload done (admission: all)
    raw_get          boto3 get_object + read of the same bytes
    remote_fetch     bluecached on B (object only remote): lookup + open + one read into the
                     client's registered region + release: HEAD, GET (parallel ranges),
                     CRC32C check, the engine's copy into the region
  prefix read (--prefix-blocks, 64 by default)
    raw_io           boto3 GETs of the 64 objects one after another (just the transfers)
    host_b_read      host B reads a prefix that host A wrote, through its mount, as the llm-d
                     backend does: os.path.exists of every block of the prefix (the hit
                     check), then open/read of each in order
    host_b_interleaved  another prefix, exists then open/read block by block (the pattern
                     of the first version of this benchmark)

Ratios: raw_put / store_upload and raw_get / remote_fetch (target >= 0.9), also
raw_put_unsigned / store_upload, raw_io / host_b_read. Results:
docs/benchmarks/remote.{json,png,md}.

    python bench/remote_bench.py            # full run, ~3 minutes on 2 cores
    python bench/remote_bench.py --quick    # smoke test, results to /tmp/bluecache-bench-quick/
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import yaml
from harness import Bluecached, Hostd, MiB, force_unmount

from bluecached.namespace import ROOT_INO
from bluecached.shm import SharedRegion
from bluecached.tiers.s3 import load_credentials, make_client

ROOT = harness.ROOT
# The Ceph cluster and the connectors' syscall sequences are test tooling shared with the
# remote-tier tests: found in tests/, by path.
sys.path.append(str(ROOT / "tests"))
from ceph_cluster import CephCluster  # noqa: E402
from connectors import block_name, llmd_read, llmd_write  # noqa: E402

OBJECT = 32 * MiB
NOTES = ROOT / "docs" / "benchmarks" / "remote-notes.md"   # the analysis, kept by hand


def versions() -> dict:
    import boto3
    import botocore
    ceph = subprocess.run(["ceph", "--version"], capture_output=True, text=True).stdout.strip()
    return {"boto3": boto3.__version__, "botocore": botocore.__version__, "ceph": ceph}


class ObjectClient:
    """Whole objects through the protocol, as hostd moves a file's bytes: one registered region
    of OBJECT bytes, parent directories made on the way."""

    def __init__(self, daemon: Bluecached):
        self.client = daemon.client()
        self.channel = daemon.regions()
        self.shm = SharedRegion(OBJECT)
        self.region = self.channel.register(self.shm)

    def _walk(self, parts: list[bytes], make: bool) -> int:
        ino = ROOT_INO
        for part in parts:
            if make:
                try:
                    ino = self.client.call("mkdir", parent=ino, name=part, mode=0o755, uid=0,
                                           gid=0)["ino"]
                    continue
                except OSError as e:
                    if e.errno != errno.EEXIST:
                        raise
            ino = self.client.call("lookup", parent=ino, name=part)["ino"]
        return ino

    def put(self, path: str, data: bytes) -> None:
        *dirs, name = [p.encode() for p in path.strip("/").split("/")]
        opened = self.client.call("create", parent=self._walk(dirs, True), name=name,
                                  mode=0o644, uid=0, gid=0,
                                  flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.shm.view[:len(data)] = data
        self.client.call("write", fh=opened["fh"], offset=0, length=len(data),
                         region=self.region, region_offset=0)
        self.client.call("release", fh=opened["fh"])

    def get(self, path: str) -> bytes:
        ino = self._walk([p.encode() for p in path.strip("/").split("/")], False)
        fh = self.client.call("open", ino=ino, flags=os.O_RDONLY)["fh"]
        try:
            n = self.client.call("read", fh=fh, offset=0, length=OBJECT, region=self.region,
                                 region_offset=0)["length"]
        finally:
            self.client.call("release", fh=fh)
        return bytes(self.shm.view[:n])

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        self.shm.close()


def remote_stats(daemon: Bluecached) -> dict:
    client = daemon.client()
    try:
        return client.call("stats")["remote"]
    finally:
        client.close()


def wait_uploads(daemon: Bluecached, count: int, timeout: float = 300) -> None:
    client = daemon.client()
    try:
        deadline = time.monotonic() + timeout
        while client.call("stats")["remote"]["uploads"] < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} uploads did not finish")
            time.sleep(0.002)
    finally:
        client.close()


def data_for(i: int) -> bytes:
    # Random bytes (incompressible), name stamped at both ends so mix-ups show.
    body = bytearray(os.urandom(OBJECT))
    stamp = f"object {i:06d}".encode().ljust(64, b".")
    body[:64] = stamp
    body[-64:] = stamp
    return bytes(body)


def read_into_region(fc: ObjectClient, parent: int, name: str) -> float:
    """lookup + open + one read into the client's region + release: the bytes land in memory
    the client owns, as a raw GET's do (the check happens outside the timed part). Returns
    the seconds the lookup took."""
    t0 = time.perf_counter()
    ino = fc.client.call("lookup", parent=parent, name=name.encode())["ino"]
    looked_up = time.perf_counter() - t0
    fh = fc.client.call("open", ino=ino, flags=os.O_RDONLY)["fh"]
    try:
        n = fc.client.call("read", fh=fh, offset=0, length=OBJECT, region=fc.region,
                           region_offset=0)["length"]
        assert n == OBJECT
    finally:
        fc.client.call("release", fh=fh)
    return looked_up


def per_object(s3, s3_unsigned, bucket: str, a: Bluecached, b: Bluecached,
               count: int) -> dict:
    fa, fb = ObjectClient(a), ObjectClient(b)
    times = {k: [] for k in ("raw_put", "raw_put_unsigned", "store_upload", "store_only",
                             "raw_get", "remote_fetch", "daemon_upload", "daemon_fetch",
                             "remote_lookup")}
    try:
        fa.put("/objects/warmup", data_for(999_999))      # directory made, daemon warm
        wait_uploads(a, 1)
        fb.get("/objects/warmup")
        objects_ino = fb.client.call("lookup", parent=1, name=b"objects")["ino"]
        for i in range(count):
            data = data_for(i)
            t0 = time.perf_counter()
            s3.put_object(Bucket=bucket, Key=f"raw/{i}", Body=data)
            times["raw_put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s3_unsigned.put_object(Bucket=bucket, Key=f"raw/{i}", Body=data)
            times["raw_put_unsigned"].append(time.perf_counter() - t0)

            up0 = remote_stats(a)["upload_seconds"]
            t0 = time.perf_counter()
            fa.put(f"/objects/{i}", data)
            times["store_only"].append(time.perf_counter() - t0)
            wait_uploads(a, i + 2)
            times["store_upload"].append(time.perf_counter() - t0)
            times["daemon_upload"].append(remote_stats(a)["upload_seconds"] - up0)

            t0 = time.perf_counter()
            got = s3.get_object(Bucket=bucket, Key=f"raw/{i}")["Body"].read()
            times["raw_get"].append(time.perf_counter() - t0)
            assert got == data

            fetch0 = remote_stats(b)["fetch_seconds"]
            t0 = time.perf_counter()
            times["remote_lookup"].append(read_into_region(fb, objects_ino, f"{i}"))
            times["remote_fetch"].append(time.perf_counter() - t0)
            times["daemon_fetch"].append(remote_stats(b)["fetch_seconds"] - fetch0)
            assert fb.shm.view[:OBJECT] == data, f"object {i} came back different"
            s3.delete_object(Bucket=bucket, Key=f"raw/{i}")
    finally:
        fa.close()
        fb.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"count": count, "object_bytes": OBJECT, "seconds": times, "median_s": med,
            "ratio_put": med["raw_put"] / med["store_upload"],
            "ratio_put_unsigned": med["raw_put_unsigned"] / med["store_upload"],
            "ratio_get": med["raw_get"] / med["remote_fetch"]}


def write_prefix(a_mnt: Path, a: Bluecached, first: int, blocks: int) -> list[str]:
    names = [block_name(first + i) for i in range(blocks)]
    before = remote_stats(a)["uploads"]
    for i, name in enumerate(names):
        llmd_write(str(a_mnt), name, data_for(i), tag="a")
    wait_uploads(a, before + blocks)
    return names


def check(got: bytes, i: int, name: str) -> None:
    assert len(got) == OBJECT and got[:64] == f"object {i:06d}".encode().ljust(64, b"."), name


def prefix_read(s3, bucket: str, a_mnt: Path, b_mnt: Path, a: Bluecached,
                b: Bluecached, blocks: int) -> dict:
    names = write_prefix(a_mnt, a, 10_000, blocks)
    t0 = time.perf_counter()
    for name in names:
        s3.get_object(Bucket=bucket, Key=name)["Body"].read()
    raw = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert all(os.path.exists(b_mnt / name) for name in names)   # the hit check
    checked = time.perf_counter() - t0
    for i, name in enumerate(names):
        check(llmd_read(str(b_mnt), name), i, name)
    host_b = time.perf_counter() - t0
    names = write_prefix(a_mnt, a, 20_000, blocks)
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        assert os.path.exists(b_mnt / name)
        check(llmd_read(str(b_mnt), name), i, name)
    interleaved = time.perf_counter() - t0
    return {"blocks": blocks, "bytes": blocks * OBJECT, "raw_io_s": raw, "host_b_read_s": host_b,
            "host_b_check_s": checked, "ratio": raw / host_b,
            "host_b_interleaved_s": interleaved, "ratio_interleaved": raw / interleaved,
            "b_remote_stats": remote_stats(b)}


def plot(plt, results: dict, path: Path) -> None:
    med = results["per_object"]["median_s"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["upload", "fetch"]
    raw = [med["raw_put"] * 1000, med["raw_get"] * 1000]
    ours = [med["store_upload"] * 1000, med["remote_fetch"] * 1000]
    x = range(len(labels))
    left.bar([i - 0.2 for i in x], raw, 0.4, label="boto3 PUT / GET")
    left.bar([i + 0.2 for i in x], ours, 0.4, label="through bluecached")
    left.set_xticks(list(x), labels)
    left.set_ylabel("ms per 32 MiB object (median)")
    left.legend()
    left.set_title("one 32 MiB object")
    p = results["prefix_read"]
    right.bar(["raw GETs", "host B via mount"], [p["raw_io_s"], p["host_b_read_s"]],
              color=["tab:blue", "tab:orange"])
    right.set_ylabel("seconds")
    right.set_title(f"prefix of {p['blocks']} blocks written by host A")
    fig.suptitle(f"remote tier on Ceph radosgw (memstore), {results['machine']['cpu_model']}, "
                 f"{results['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def baselines(results: dict) -> str:
    runs = results.get("baselines") or []
    if not runs:
        return ""
    rows = "\n".join(
        f"| {r['label']} | {r['upload']:.2f} | {r['fetch']:.2f} | {r['check_s']:.2f} s | "
        f"{r['read_s']:.2f} s ({r['ratio']:.2f}) | {r['interleaved_s']:.2f} s "
        f"({r['ratio_interleaved']:.2f}) |" for r in runs)
    return f"""
Runs compared (the same script, on this machine, one after another; `--baseline` JSONs):

| run | upload ratio | fetch ratio | prefix check | llm-d read | interleaved |
|---|---|---|---|---|---|
{rows}
"""


def summary(label: str, results: dict) -> dict:
    o, p = results["per_object"], results["prefix_read"]
    return {"label": label, "upload": o["ratio_put"], "fetch": o["ratio_get"],
            "upload_unsigned": o.get("ratio_put_unsigned"),
            "check_s": p["host_b_check_s"], "read_s": p["host_b_read_s"], "ratio": p["ratio"],
            "interleaved_s": p["host_b_interleaved_s"],
            "ratio_interleaved": p["ratio_interleaved"]}


def markdown(results: dict) -> str:
    o, p, m = results["per_object"], results["prefix_read"], results["machine"]
    med = {k: f"{v * 1000:.0f} ms" for k, v in o["median_s"].items()}
    upload = (f"| upload | PUT {med['raw_put']} | store + upload {med['store_upload']} "
              f"(store alone {med['store_only']}) | {o['ratio_put']:.2f} |")
    upload_same = (f"| upload, payload signing off on both sides | PUT "
                   f"{med['raw_put_unsigned']} | store + upload {med['store_upload']} | "
                   f"{o['ratio_put_unsigned']:.2f} |")
    fetch = (f"| fetch | GET {med['raw_get']} | lookup + read on host B {med['remote_fetch']} "
             f"| {o['ratio_get']:.2f} |")
    llmd = (f"| llm-d: exists of every block ({p['host_b_check_s']:.2f} s), then open + read "
            f"each | {p['host_b_read_s']:.2f} s | {p['ratio']:.2f} |")
    interleaved = (f"| interleaved: exists, open, read, block by block (another prefix) | "
                   f"{p['host_b_interleaved_s']:.2f} s | {p['ratio_interleaved']:.2f} |")
    return f"""# Remote tier benchmark (bench/remote_bench.py)

Run {results['created']} on {m['host']}: {m['cpu_model']}, {m['cores']} cores,
{m['memory_bytes'] >> 30} GiB, Linux {m['kernel']}; {m['ceph']}; boto3 {m['boto3']}; git
{results['git']['commit']}. Single-node Ceph (memstore OSD, radosgw on
loopback) on the same machine as both bluecache instances and the client: every number
includes Ceph's own CPU use on the same 2 cores. Nothing here ran on a BlueField DPU.

| 32 MiB object, median of {o['count']} | plain boto3 | through bluecached | ratio (target >= 0.9) |
|---|---|---|---|
{upload}
{upload_same}
{fetch}

Inside bluecached (medians): upload {med['daemon_upload']} in S3 calls; on host B the lookup
took {med['remote_lookup']} and the S3 download (started by the lookup) {med['daemon_fetch']}.
Daemon settings: `{json.dumps(results.get('daemon_settings', {}))}`.

Host B reading a {p['blocks']}-block prefix ({p['bytes'] >> 20} MiB) that host A wrote, through
its mount, against {p['raw_io_s']:.2f} s for the {p['blocks']} plain GETs alone:

| pattern | host B | ratio |
|---|---|---|
{llmd}
{interleaved}
{baselines(results)}

What the bluecached side does on top of the raw client: upload: the store through the
protocol (DRAM), queueing, a CRC32C per 1 MiB chunk (the object's CRC derived from them), one
PUT (multipart above `multipart_threshold`, 64 MiB by default) read straight from the DRAM
chunks, payload unsigned; fetch: the lookup's GET (no HEAD first when a prefetch slot is
free) whose body becomes the prefetch, ranged GETs pinned to the ETag above the threshold,
each chunk's CRC32C checked as it arrives, the engine's copy of each checked run into the
client's region while the rest still arrives. `json`: every sample.

![remote tier](remote.png)

{NOTES.read_text() if NOTES.exists() else ""}"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=12)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="3 objects, 8 blocks, results to "
                    "/tmp/bluecache-bench-quick/")
    ap.add_argument("--dir", type=Path, help="working directory (default: a new one in /var/tmp)")
    ap.add_argument("--out", type=Path, help="results directory (default docs/benchmarks)")
    ap.add_argument("--baseline", action="append", default=[], metavar="LABEL=JSON",
                    help="an earlier run's remote.json to list beside this one in the .md")
    ap.add_argument("--remote", action="append", default=[], metavar="KEY=VALUE",
                    help="extra remote: settings for both daemons, e.g. multipart_threshold=64MiB")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="other daemon settings for both daemons, e.g. tiers.dram.prefault=0")
    args = ap.parse_args()
    out = ROOT / "docs" / "benchmarks"
    if args.quick:
        args.objects, args.prefix_blocks = 3, 8
        out = Path("/tmp/bluecache-bench-quick")
    out = args.out or out
    out.mkdir(parents=True, exist_ok=True)
    work = args.dir or Path(tempfile.mkdtemp(prefix="bluecache-remote-bench-", dir="/var/tmp"))
    cluster = CephCluster(work / "ceph", memstore_bytes=(2 * args.prefix_blocks + 8) * OBJECT
                          + (1 << 30))
    stacks = []
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"ceph up in {time.monotonic() - t0:.1f}s at {cluster.endpoint}", flush=True)
        s3 = cluster.s3_client()
        s3.create_bucket(Bucket="bench")
        creds = cluster.write_credentials(work / "s3-credentials")
        extra = dict(kv.split("=", 1) for kv in args.remote)
        remote = cluster.s3_settings("bench", creds, **extra)
        nvme = f"{(2 * args.prefix_blocks + args.objects + 8) * 32 + 1024}MiB"
        settings = {"tiers.dram.size": "512MiB", "tiers.nvme.size": nvme,
                    "tiers.nvme.segment_size": "1GiB"}
        settings.update((k, yaml.safe_load(v)) for k, v in (kv.split("=", 1) for kv in args.set))
        for name in ("a", "b"):
            d = Bluecached(work / name, remote=remote, **settings).start()
            h = Hostd(d, work / f"mnt-{name}").start()
            stacks.append((d, h))
        (a, _), (b, _) = stacks
        results = harness.run_info("remote_bench", **versions())
        results.update({"remote_settings": {k: v for k, v in remote.items()
                                            if k != "credentials_file"},
                        "daemon_settings": settings})
        unsigned = make_client(cluster.endpoint, "us-east-1", load_credentials(creds), None, True,
                               "path", 30, 10, sign_payload=False)
        results["per_object"] = per_object(s3, unsigned, "bench", a, b, args.objects)
        print(json.dumps(results["per_object"]["median_s"]), flush=True)
        results["prefix_read"] = prefix_read(s3, "bench", work / "mnt-a", work / "mnt-b", a, b,
                                             args.prefix_blocks)
    finally:
        for d, h in stacks:
            h.stop()
            force_unmount(h.mountpoint)
            d.stop()
        cluster.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    results["baselines"] = [summary(label, json.loads(Path(file).read_text()))
                            for label, file in (b.split("=", 1) for b in args.baseline)]
    results["baselines"].append(summary("this run", results))
    harness.write_results(out, "remote", results, markdown(results),
                          lambda plt, path: plot(plt, results, path), indent=1)
    o, p = results["per_object"], results["prefix_read"]
    print(f"upload ratio {o['ratio_put']:.2f}, fetch ratio {o['ratio_get']:.2f}, "
          f"prefix read {p['host_b_read_s']:.2f}s vs raw {p['raw_io_s']:.2f}s "
          f"({p['ratio']:.2f}), interleaved {p['host_b_interleaved_s']:.2f}s "
          f"({p['ratio_interleaved']:.2f}); results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
