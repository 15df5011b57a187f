#!/usr/bin/env python3
"""Put/get throughput of 32 MiB objects through a real bluecached, against plain files.

One run measures, for each client concurrency (default 1, 8 and 32; ~1 GiB per point):

  bluecached   put       create + write + release           (acknowledged from DRAM: write-behind)
               get       lookup + open + read + release     (DRAM hits)
               get_nvme  the same gets after a daemon restart (SIGTERM) and a page-cache drop:
                         every object is promoted from the NVMe tier with its CRC32C checked
  baseline     write     os.open + os.write + os.close      (no fsync, like write-behind)
               read_warm os.open + os.readv + os.close      (page cache hot, right after writing)
               read_cold the same after sync + drop_caches  (what get_nvme is compared with)

Each object is one 32 MiB write / read request (--piece to change). Clients are threads of this
process; each has its own SyncClient (one zmq DEALER, one daemon session), its own RegionChannel
and its own 32 MiB SharedRegion (a sealed memfd) registered with the daemon. The baseline
threads write from and read into those same buffers, so both sides move the same bytes between
the same memory. Object bytes are random, with the object's name stamped into the first and
last 64 bytes; every get and read checks both stamps.

Steady state, not first touch: after every daemon start the daemon is warmed up (each region
copied once both ways, one round of chunks through its DRAM pool, nothing written to NVMe), and
the baseline's page cache is pre-touched right before its write phase (see pre_touch). Every
point runs --repeat times, interleaved; the table and the plot show medians.

Then it measures daemon start time with a big index: bench/index_rebuild.py (Journal.load +
SegmentStore.rebuild alone, 100k records), and a real daemon restarted over 20k 4 KiB files
created through the protocol (after SIGKILL: journal replay; after SIGTERM: snapshot).

    python bench/store_bench.py          # full run -> docs/benchmarks/store.{json,md,png}
    python bench/store_bench.py --quick  # smoke test -> /tmp/bluecache-bench-quick/

See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
from harness import GiB, KiB, MiB, drop_caches

from bluecached.config import parse_size
from bluecached.namespace import ROOT_INO
from bluecached.shm import SharedRegion
from bluecached.wire.client import RegionChannel, SyncClient

ROOT = harness.ROOT
OBJECT_SIZE = 32 * MiB
STAMP = 64  # bytes of the object's name at the start and at the end of each object
CALL_TIMEOUT = 300.0


# -- machine -------------------------------------------------------------------------------------


def mount_of(path: Path) -> dict:
    """The mount holding path (longest mount point that is a prefix of its real path)."""
    real = os.path.realpath(path)
    best = {"mount_point": "?", "fs_type": "unknown", "device": "?"}
    best_len = -1
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), mnt)
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) > best_len:
                best, best_len = {"mount_point": mnt, "fs_type": fstype, "device": dev}, len(mnt)
    return best


def free_page_reporting() -> bool | None:
    """Whether a virtio-balloon device with free page reporting is bound (see pre_touch)."""
    found = None
    with contextlib.suppress(OSError):
        for dev in Path("/sys/bus/virtio/devices").iterdir():
            if (dev / "device").read_text().strip() == "0x0005":  # balloon
                found = (dev / "features").read_text().strip()[5:6] == "1"  # F_REPORTING
    return found


def machine_extra(work: Path) -> dict:
    """What this bench adds to harness.machine_info: the disk under test and how it runs."""
    return {"python_impl": platform.python_implementation(), "dir": str(work),
            "dir_mount": mount_of(work), "running_as_root": os.geteuid() == 0,
            "free_page_reporting": free_page_reporting()}


# -- a bluecached process ------------------------------------------------------------------------


class Daemon:
    """bluecached (harness.Bluecached) and what this bench times of it: seconds from start to
    READY=1 and to an answered `hello`, the index rebuild it logged, the stop; and one
    long-lived admin connection."""

    def __init__(self, root: Path, settings: dict):
        self.bluecached = harness.Bluecached(root, **{"log_level": "info", **settings})
        self.settings = self.bluecached.settings
        self.endpoints = self.bluecached.endpoints
        self.log = self.bluecached.log
        self._log_from = 0
        self.admin: SyncClient | None = None

    @property
    def pid(self) -> int:
        return self.bluecached.proc.pid

    def start(self, timeout: float = 600) -> dict:
        """Starts the daemon; returns seconds until READY=1 and until `hello` was answered, and
        the index rebuild line the daemon logged."""
        control_sock = Path(self.endpoints["control"][len("ipc://"):])
        with contextlib.suppress(FileNotFoundError):
            control_sock.unlink()  # so its appearance means "bound by this start"
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        self.bluecached.start(wait=False)
        proc, t0 = self.bluecached.proc, self.bluecached.process.started_at
        deadline = t0 + timeout
        hello_at = None
        while hello_at is None:  # poll for the control socket, then time one hello
            if proc.poll() is not None:
                raise RuntimeError(f"bluecached exited with {proc.returncode}:\n"
                                   + self.new_log())
            if time.time() > deadline:
                raise RuntimeError("bluecached did not bind its control socket:\n"
                                   + self.new_log())
            if control_sock.exists():
                try:
                    client = SyncClient(self.endpoints["control"], timeout=5,
                                        client_name="store_bench")
                except OSError as e:  # no answer yet (or it died): look again
                    if e.errno != errno.ETIMEDOUT:
                        raise
                    continue
                hello_at = time.time()
                client.close()
            else:
                time.sleep(0.002)
        ready_at = self.bluecached.wait_ready(max(0.0, deadline - time.time()))
        self.admin = self.client()
        rebuilt = re.search(r"index rebuilt: (\d+) files, (\d+) inodes from (\d+) records in "
                            r"([0-9.]+)s", self.new_log())
        out = {"ready_s": round(ready_at - t0, 4), "hello_s": round(hello_at - t0, 4)}
        if rebuilt:
            out["index"] = {"files": int(rebuilt[1]), "inodes": int(rebuilt[2]),
                            "records": int(rebuilt[3]), "load_s": float(rebuilt[4])}
        return out

    def client(self) -> SyncClient:
        return SyncClient(self.endpoints["control"], timeout=CALL_TIMEOUT,
                          client_name="store_bench")

    def call(self, op: str, **args):
        """One request on this daemon's long-lived admin connection."""
        return self.admin.call(op, **args)

    def stop(self, sig=signal.SIGTERM, timeout: float = 900) -> float:
        """Signals the daemon and waits; returns seconds until it exited."""
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        t0 = time.perf_counter()
        if self.bluecached.process and self.bluecached.process.running():
            status = self.bluecached.stop(sig, timeout)
            if self.bluecached.process.killed:
                raise RuntimeError(f"bluecached did not exit within {timeout}s of {sig!r}")
            if sig == signal.SIGTERM and status != 0:
                raise RuntimeError(f"bluecached exited with {status} on SIGTERM:\n"
                                   + self.new_log())
        return round(time.perf_counter() - t0, 4)

    def new_log(self) -> str:
        with contextlib.suppress(OSError), open(self.log, "rb") as f:
            f.seek(self._log_from)
            return f.read().decode(errors="replace")
        return ""

    def log_problems(self) -> list[str]:
        """WARNING/ERROR lines and tracebacks anywhere in this daemon's log."""
        return self.bluecached.unexpected_log_lines()

    def cleanup(self) -> None:
        self.bluecached.cleanup()


# -- clients -------------------------------------------------------------------------------------


class Worker:
    """One client: a 32 MiB shared region of random bytes, and (while attached) its own control
    connection and region channel to the daemon."""

    def __init__(self, index: int, size: int):
        self.index = index
        self.size = size
        self.shm = SharedRegion(size, name=f"store-bench-{index}")
        block = os.urandom(MiB)
        for pos in range(0, size, MiB):
            n = min(MiB, size - pos)
            self.shm.view[pos:pos + n] = block[:n]
        self.client: SyncClient | None = None
        self.channel: RegionChannel | None = None
        self.region = 0
        # Entries this session was given (create, lookup): the daemon counts them like FUSE
        # lookup counts and keeps an unlinked file until they are forgotten.
        self.known: dict[int, int] = {}

    def note(self, attr: dict) -> None:
        self.known[attr["ino"]] = self.known.get(attr["ino"], 0) + 1

    def forget_all(self) -> None:
        if self.client is None or not self.known:
            return
        items = list(self.known.items())
        self.known.clear()
        for i in range(0, len(items), 4096):
            part = items[i:i + 4096]
            try:
                self.client.call("forget", inos=[k for k, _ in part], counts=[n for _, n in part])
            except OSError as e:
                if e.errno != errno.ENOSYS:  # a daemon without forget keeps nothing
                    raise
                return

    def attach(self, daemon: Daemon) -> None:
        self.client = daemon.client()
        self.channel = RegionChannel(daemon.endpoints["regions"])
        self.region = self.channel.register(self.shm)

    def detach(self, forget: bool = True) -> None:
        """Closes the connections, first returning this session's references (unless the
        daemon is gone)."""
        if forget:
            self.forget_all()
        self.known.clear()
        if self.channel is not None:
            self.channel.close()
        if self.client is not None:
            self.client.close()
        self.client = self.channel = None

    # object identity in the bytes, so a read that returned the wrong object (or nothing) shows

    def stamp(self, name: bytes) -> None:
        mark = name.ljust(STAMP, b".")[:STAMP]
        self.shm.view[:STAMP] = mark
        self.shm.view[self.size - STAMP:] = mark

    def unstamp(self) -> None:
        self.shm.view[:STAMP] = bytes(STAMP)
        self.shm.view[self.size - STAMP:] = bytes(STAMP)

    def check(self, name: bytes) -> None:
        mark = name.ljust(STAMP, b".")[:STAMP]
        if self.shm.view[:STAMP] != mark or self.shm.view[self.size - STAMP:] != mark:
            raise RuntimeError(f"object {name!r} read back with the wrong bytes")

    def close(self) -> None:
        self.detach(forget=False)
        self.shm.close()


DISK_STAT: Path | None = None  # /sys/dev/block/M:m/stat of the device holding --dir


def block_stat_path(path: Path) -> Path | None:
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def disk_counters() -> tuple[int, ...]:
    """(read I/Os, read sectors, write I/Os, write sectors) of the device holding --dir."""
    if DISK_STAT is None:
        return (0, 0, 0, 0)
    try:
        f = DISK_STAT.read_text().split()
    except OSError:
        return (0, 0, 0, 0)
    return int(f[0]), int(f[2]), int(f[4]), int(f[6])


def disk_delta(after: tuple, before: tuple) -> dict:
    r_ios, r_sec, w_ios, w_sec = (a - b for a, b in zip(after, before, strict=True))
    return {"read_ios": r_ios, "read_mib": round(r_sec * 512 / MiB, 1),
            "avg_read_kib": round(r_sec * 512 / KiB / r_ios, 1) if r_ios else 0,
            "write_ios": w_ios, "write_mib": round(w_sec * 512 / MiB, 1),
            "avg_write_kib": round(w_sec * 512 / KiB / w_ios, 1) if w_ios else 0}


def cpu_seconds(pid: int | None) -> tuple[float, float, float]:
    """(CPU seconds of process pid, of this process, of the whole machine) so far."""
    t = os.times()
    return (harness.proc_cpu(pid) or 0.0, t.user + t.system,
            harness.system_busy()[0] / harness.TICK)


def run_phase(workers: list[Worker], names: list[list[bytes]], op, pid: int | None = None) -> dict:
    """Runs op(worker, name) for each worker's names in one thread per worker, all released at
    once; returns wall time, throughput, per-object latency and CPU time (the daemon `pid`'s,
    this process's, and everything else on the machine)."""
    barrier = threading.Barrier(len(workers) + 1)
    latencies: list[list[float]] = [[] for _ in workers]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            w = workers[i]
            for name in names[i]:
                t = time.perf_counter()
                op(w, name)
                latencies[i].append(time.perf_counter() - t)
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
        t.start()
    cpu0 = cpu_seconds(pid)
    disk0 = disk_counters()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    cpu1 = cpu_seconds(pid)
    disk1 = disk_counters()
    if errors:
        raise errors[0]
    lat = sorted(x for per in latencies for x in per)
    count = len(lat)
    total = count * workers[0].size
    return {
        "objects": count,
        "bytes": total,
        "seconds": round(seconds, 4),
        "mib_s": round(total / MiB / seconds, 1),
        "latency_ms": {"p50": round(1000 * statistics.median(lat), 2),
                       "p99": round(1000 * lat[min(count - 1, int(0.99 * count))], 2),
                       "max": round(1000 * lat[-1], 2)},
        "cpu_s": {"daemon": round(cpu1[0] - cpu0[0], 3), "client": round(cpu1[1] - cpu0[1], 3),
                  "others": round(max(0.0, (cpu1[2] - cpu0[2]) - (cpu1[0] - cpu0[0])
                                      - (cpu1[1] - cpu0[1])), 3)},
        "disk": disk_delta(disk1, disk0),
    }


# bluecached operations (what hostd does for one file)


def bc_put(piece: int, parent: int):
    def put(w: Worker, name: bytes) -> None:
        w.stamp(name)
        c = w.client
        opened = c.call("create", parent=parent, name=name, mode=0o644, uid=0, gid=0,
                        flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        w.note(opened["attr"])
        fh = opened["fh"]
        for pos in range(0, w.size, piece):
            n = min(piece, w.size - pos)
            c.call("write", fh=fh, offset=pos, length=n, region=w.region, region_offset=pos)
        c.call("release", fh=fh)
    return put


def bc_get(piece: int, parent: int):
    def get(w: Worker, name: bytes) -> None:
        w.unstamp()
        c = w.client
        attr = c.call("lookup", parent=parent, name=name)
        w.note(attr)
        fh = c.call("open", ino=attr["ino"], flags=os.O_RDONLY)["fh"]
        pos = 0
        try:
            while pos < w.size:
                n = c.call("read", fh=fh, offset=pos, length=min(piece, w.size - pos),
                           region=w.region, region_offset=pos)["length"]
                if not n:
                    break
                pos += n
        finally:
            c.call("release", fh=fh)
        if pos != w.size:
            raise RuntimeError(f"{name!r}: read {pos} of {w.size} bytes")
        w.check(name)
    return get


# baseline: plain files, same buffers, same piece size


def fs_write(piece: int, directory: Path, overwrite: bool = False):
    """New files (O_TRUNC), or with overwrite the existing, cached files in place: their page
    cache pages are reused as the daemon reuses its DRAM chunks, so no memory is allocated."""
    def write(w: Worker, name: bytes) -> None:
        w.stamp(name)
        flags = os.O_WRONLY | os.O_CLOEXEC | (0 if overwrite else os.O_CREAT | os.O_TRUNC)
        fd = os.open(directory / name.decode(), flags, 0o644)
        try:
            view = w.shm.view
            pos = 0
            while pos < w.size:
                pos += os.write(fd, view[pos:min(pos + piece, w.size)])
        finally:
            os.close(fd)
    return write


def pre_touch(directory: Path, w: Worker, objects: int, piece: int) -> dict:
    """Writes and deletes a scratch file as large as the next write phase, right before it.

    This guest hands free memory back to its host (virtio-balloon free page reporting), so
    memory that has been free for a couple of seconds costs a host page fault per page when it
    is used again: ~350 MB/s instead of several GB/s. The daemon keeps its DRAM chunks for reuse
    (and is warmed up once per start); without this the baseline's page cache would pay that
    cost and the daemon's would not. Returns the first-touch write rate seen."""
    path = directory / ".pre-touch"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for _ in range(objects):
            pos = 0
            while pos < w.size:
                pos += os.write(fd, w.shm.view[pos:min(pos + piece, w.size)])
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"bytes": objects * w.size, "seconds": round(seconds, 4),
            "first_touch_write_mib_s": round(objects * w.size / MiB / seconds, 1)}


def fs_read(piece: int, directory: Path):
    def read(w: Worker, name: bytes) -> None:
        w.unstamp()
        fd = os.open(directory / name.decode(), os.O_RDONLY | os.O_CLOEXEC)
        try:
            view = w.shm.view
            pos = 0
            while pos < w.size:
                n = os.readv(fd, [view[pos:min(pos + piece, w.size)]])
                if not n:
                    break
                pos += n
        finally:
            os.close(fd)
        if pos != w.size:
            raise RuntimeError(f"{name!r}: read {pos} of {w.size} bytes")
        w.check(name)
    return read


# -- the daemon's view ---------------------------------------------------------------------------


def wait_drained(daemon: Daemon, timeout: float = 300) -> float:
    """Waits until write-behind has put every dirty byte on NVMe; returns the seconds waited."""
    t0 = time.perf_counter()
    while (stats := daemon.call("stats"))["dirty_bytes"]:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"write-behind did not drain within {timeout}s: {stats}")
        time.sleep(0.01)
    return round(time.perf_counter() - t0, 4)


def tier_counters(stats: dict) -> dict:
    t = stats["tiers"]
    return {"dram_hits": t["dram"]["hits"], "dram_misses": t["dram"]["misses"],
            "nvme_hits": t.get("nvme", {}).get("hits", 0),
            "dram_evictions": t["dram"]["evictions"],
            "checksum_failures": stats["checksum_failures"],
            "writeback_failures": stats["writeback_failures"]}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


class Profiler:
    """Optional py-spy record of the daemon for the length of one phase."""

    def __init__(self, out_dir: Path | None, fmt: str = "flamegraph"):
        self.out_dir = out_dir
        self.fmt = fmt
        self.count = 0

    @contextlib.contextmanager
    def record(self, pid: int, label: str):
        if self.out_dir is None:
            yield
            return
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.count += 1
        suffix = {"flamegraph": "svg", "raw": "txt", "speedscope": "json"}[self.fmt]
        out = self.out_dir / f"{self.count:02d}-{label}.{suffix}"
        proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--threads", "--output",
                                 str(out), "--rate", "200", "--format", self.fmt],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let it attach
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)


# -- the throughput points -----------------------------------------------------------------------


def per_worker_names(concurrency: int, objects: int) -> list[list[bytes]]:
    each = objects // concurrency
    return [[f"obj-{c:02d}-{i:04d}".encode() for i in range(each)] for c in range(concurrency)]


def warm_up(daemon: Daemon, workers: list[Worker], objects: int, piece: int) -> dict:
    """Makes a freshly started daemon look like one that has been serving for a while, so the
    phases measure steady state rather than first-touch page faults: the daemon maps every
    client region (its first copy from and to each region faults the pages in) and its DRAM
    pool gets `objects` objects' worth of chunks that it keeps for reuse once freed. The objects
    are unlinked while still open, so nothing is written to NVMe. Returns how fast those
    first-touch puts went (one client at a time)."""
    c = workers[0].client
    parent = c.call("mkdir", parent=ROOT_INO, name=b".warmup", mode=0o755, uid=0, gid=0)["ino"]
    handles = []
    t0 = time.perf_counter()
    for k in range(objects):
        w = workers[k % len(workers)]
        name = f"warm-{k:04d}".encode()
        opened = w.client.call("create", parent=parent, name=name, mode=0o644, uid=0, gid=0,
                               flags=os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        w.note(opened["attr"])
        fh = opened["fh"]
        for pos in range(0, w.size, piece):
            w.client.call("write", fh=fh, offset=pos, length=min(piece, w.size - pos),
                          region=w.region, region_offset=pos)
        handles.append((w, name, fh))
    seconds = time.perf_counter() - t0
    for w, _, fh in handles[:len(workers)]:  # each region once in the other direction
        for pos in range(0, w.size, piece):
            w.client.call("read", fh=fh, offset=pos, length=min(piece, w.size - pos),
                          region=w.region, region_offset=pos)
    for w, name, fh in handles:
        w.client.call("unlink", parent=parent, name=name)
        w.client.call("release", fh=fh)
    for w in workers:
        w.forget_all()  # now the unlinked objects go, and their chunks return to the pool
    c.call("rmdir", parent=ROOT_INO, name=b".warmup")
    return {"objects": objects, "seconds": round(seconds, 4),
            "first_touch_put_mib_s": round(objects * OBJECT_SIZE / MiB / seconds, 1)}


def attach(daemon: Daemon, workers: list[Worker], warm_objects: int, piece: int) -> dict:
    for w in workers:
        w.attach(daemon)
    return warm_up(daemon, workers, warm_objects, piece) if warm_objects else {}


def detach(workers: list[Worker]) -> None:
    for w in workers:
        w.detach()


def throughput_point(daemon: Daemon, workers_all: list[Worker], concurrency: int, objects: int,
                     piece: int, warm_objects: int, base_dir: Path, profiler: Profiler,
                     notes: list[str]) -> dict:
    """One concurrency point. On entry every worker is attached to a warmed-up daemon; on exit
    too (the daemon has been restarted in between)."""
    workers = workers_all[:concurrency]
    names = per_worker_names(concurrency, objects)
    dirname = f"c{concurrency}".encode()
    point: dict = {"concurrency": concurrency, "objects": objects,
                   "objects_per_client": objects // concurrency,
                   "bytes": objects * OBJECT_SIZE}

    # bluecached: put, write-behind drain, get from DRAM
    bc: dict = {}
    os.sync()
    parent = daemon.call("mkdir", parent=ROOT_INO, name=dirname, mode=0o755, uid=0, gid=0)["ino"]
    before = tier_counters(daemon.call("stats"))
    with profiler.record(daemon.pid, f"c{concurrency}-put"):
        bc["put"] = run_phase(workers, names, bc_put(piece, parent), daemon.pid)
    bc["put"]["drain_s"] = wait_drained(daemon)
    bc["put"]["put_plus_drain_mib_s"] = round(
        bc["put"]["bytes"] / MiB / (bc["put"]["seconds"] + bc["put"]["drain_s"]), 1)
    with profiler.record(daemon.pid, f"c{concurrency}-get"):
        bc["get"] = run_phase(workers, names, bc_get(piece, parent), daemon.pid)
    bc["get"]["tiers"] = delta(tier_counters(daemon.call("stats")), before)

    # restart: DRAM is empty afterwards, every get is a promotion from NVMe
    detach(workers_all)
    bc["restart"] = {"sigterm_stop_s": daemon.stop()}
    bc["restart"].update(daemon.start())
    bc["restart"]["warm_up"] = attach(daemon, workers_all, warm_objects, piece)
    failed = drop_caches(1)
    if failed:
        notes.append(f"c{concurrency}: page cache NOT dropped before get_nvme: {failed}")
    parent = daemon.call("lookup", parent=ROOT_INO, name=dirname)["ino"]
    before = tier_counters(daemon.call("stats"))
    with profiler.record(daemon.pid, f"c{concurrency}-get_nvme"):
        bc["get_nvme"] = run_phase(workers, names, bc_get(piece, parent), daemon.pid)
    bc["get_nvme"]["page_cache_dropped"] = failed is None
    bc["get_nvme"]["tiers"] = tiers = delta(tier_counters(daemon.call("stats")), before)
    if tiers["nvme_hits"] != objects or tiers["checksum_failures"]:
        notes.append(f"c{concurrency}: get_nvme expected {objects} NVMe promotions, "
                     f"counters say {tiers}")
    for per in names:
        for name in per:
            daemon.call("unlink", parent=parent, name=name)
    for w in workers_all:
        w.forget_all()
    daemon.call("rmdir", parent=ROOT_INO, name=dirname)
    stats = daemon.call("stats")
    if stats["files"] or stats["dirty_bytes"]:
        notes.append(f"c{concurrency}: after unlinking everything the daemon still reports "
                     f"{stats['files']} files and {stats['dirty_bytes']} dirty bytes")
    point["bluecached"] = bc

    # baseline: plain files in the same file system
    base: dict = {}
    directory = base_dir / dirname.decode()
    directory.mkdir(parents=True)
    try:
        os.sync()
        if warm_objects:
            base["pre_touch"] = pre_touch(directory, workers[0], objects, piece)
        base["write"] = run_phase(workers, names, fs_write(piece, directory))
        t = time.perf_counter()
        os.sync()
        base["write"]["sync_s"] = round(time.perf_counter() - t, 4)
        base["write"]["write_plus_sync_mib_s"] = round(
            base["write"]["bytes"] / MiB / (base["write"]["seconds"] + base["write"]["sync_s"]), 1)
        base["read_warm"] = run_phase(workers, names, fs_read(piece, directory))
        base["write_overwrite"] = run_phase(workers, names,
                                            fs_write(piece, directory, overwrite=True))
        failed = drop_caches(1)
        if failed:
            notes.append(f"c{concurrency}: page cache NOT dropped before read_cold: {failed}")
        base["read_cold"] = run_phase(workers, names, fs_read(piece, directory))
        base["read_cold"]["page_cache_dropped"] = failed is None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    point["baseline"] = base

    def ratio(a: dict, b: dict) -> float:
        return round(a["mib_s"] / b["mib_s"], 3)
    point["ratio"] = {
        "put_vs_write": ratio(bc["put"], base["write"]),
        "put_vs_overwrite": ratio(bc["put"], base["write_overwrite"]),
        "get_vs_read_warm": ratio(bc["get"], base["read_warm"]),
        "get_vs_read_cold": ratio(bc["get"], base["read_cold"]),
        "get_nvme_vs_read_cold": ratio(bc["get_nvme"], base["read_cold"]),
    }
    return point


# -- index rebuild -------------------------------------------------------------------------------


def offline_index_rebuild(objects: int, work: Path, notes: list[str]) -> dict:
    script = ROOT / "bench" / "index_rebuild.py"
    if not script.exists():
        notes.append("bench/index_rebuild.py not found: offline index rebuild not measured")
        return {"skipped": "bench/index_rebuild.py not found"}
    out = work / "index_rebuild.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--objects", str(objects),
                           "--dir", str(work / "index_rebuild"), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    shutil.rmtree(work / "index_rebuild", ignore_errors=True)
    if proc.returncode != 0:
        notes.append(f"bench/index_rebuild.py failed ({proc.returncode}): "
                     f"{proc.stderr.strip()[-500:]}")
        return {"failed": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    result = json.loads(out.read_text())
    for key in ("benchmark", "created", "command", "machine", "git"):
        result.pop(key, None)  # the same run as this file's
    result["script_wall_s"] = round(wall, 2)
    return result


def populate_small(daemon: Daemon, count: int, clients: int, size: int, per_dir: int) -> dict:
    """Creates `count` files of `size` bytes through the protocol, spread over directories of
    `per_dir` files, from `clients` threads."""
    ndirs = -(-count // per_dir)
    dirs = [daemon.call("mkdir", parent=ROOT_INO, name=f"d{d:04d}".encode(), mode=0o755,
                        uid=0, gid=0)["ino"] for d in range(ndirs)]
    region = -(-size // 4096) * 4096
    workers = [Worker(i, region) for i in range(clients)]
    errors: list[BaseException] = []
    done = [0] * clients

    def body(i: int) -> None:
        w = workers[i]
        try:
            c = w.client
            for k in range(i, count, clients):
                fh = c.call("create", parent=dirs[k // per_dir], name=f"f{k:07d}".encode(),
                            mode=0o644, uid=0, gid=0,
                            flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)["fh"]
                c.call("write", fh=fh, offset=0, length=size, region=w.region, region_offset=0)
                c.call("release", fh=fh)
                done[i] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    for w in workers:
        w.attach(daemon)
    try:
        threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        for w in workers:
            w.close()
    if errors:
        raise errors[0]
    drain = wait_drained(daemon)
    return {"files": sum(done), "file_bytes": size, "directories": ndirs, "clients": clients,
            "create_s": round(seconds, 3), "files_per_s": round(sum(done) / seconds, 1),
            "drain_s": drain}


def daemon_restart_index(work: Path, files: int, clients: int, settings: dict,
                         notes: list[str]) -> dict:
    daemon = Daemon(work / "index_daemon", settings)
    out: dict = {}
    try:
        out["empty_start"] = daemon.start()
        out["populate"] = populate_small(daemon, files, clients, 4 * KiB, 1000)
        stats = daemon.call("stats")
        out["populate"]["nvme_objects"] = stats["tiers"]["nvme"]["objects"]
        out["populate"]["dram_evictions"] = stats["tiers"]["dram"]["evictions"]
        # SIGKILL: no checkpoint, so the next start replays every journal record
        daemon.stop(signal.SIGKILL)
        drop_caches(1)
        out["after_sigkill"] = daemon.start()
        out["after_sigkill"]["files_served"] = daemon.call("stats")["files"]
        # SIGTERM: flush + checkpoint, so the next start reads one snapshot
        out["sigterm_stop_s"] = daemon.stop()
        drop_caches(1)
        out["after_sigterm"] = daemon.start()
        out["after_sigterm"]["files_served"] = daemon.call("stats")["files"]
        for key in ("after_sigkill", "after_sigterm"):
            if out[key]["files_served"] != files:
                notes.append(f"daemon restart ({key}): {out[key]['files_served']} files served "
                             f"after the restart, {files} were created")
        base = out["empty_start"]["hello_s"]
        per = (out["after_sigterm"]["hello_s"] - base) / files
        out["extrapolated_100k_hello_s"] = round(base + per * 100_000, 2)
        nvme_dir = Path(daemon.settings["tiers.nvme.path"])
        out["index_dir_bytes"] = sum(p.stat().st_size for p in nvme_dir.glob("*")
                                     if p.name.startswith(("index", "journal")))
        out["log_problems"] = daemon.log_problems()[:20]
        daemon.stop()
    finally:
        daemon.cleanup()
        shutil.rmtree(work / "index_daemon", ignore_errors=True)
    return out


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs of one point (ratios of medians), with every run kept."""
    first = runs[0]
    out = {k: first[k] for k in ("concurrency", "objects", "objects_per_client", "bytes")}
    out["repeats"] = len(runs)
    med = statistics.median
    for side in ("bluecached", "baseline"):
        out[side] = {}
        for phase, v in first[side].items():
            if not (isinstance(v, dict) and "mib_s" in v):
                continue
            rs = [r[side][phase] for r in runs]
            vals = [x["mib_s"] for x in rs]
            summary = {"mib_s": round(med(vals), 1), "mib_s_min": min(vals),
                       "mib_s_max": max(vals), "mib_s_runs": vals,
                       "latency_ms_p50": round(med(x["latency_ms"]["p50"] for x in rs), 2),
                       "latency_ms_p99": round(med(x["latency_ms"]["p99"] for x in rs), 2),
                       "cpu_s": {k: round(med(x["cpu_s"][k] for x in rs), 3)
                                 for k in v["cpu_s"]},
                       "disk_avg_read_kib": round(med(x["disk"]["avg_read_kib"] for x in rs), 1),
                       "disk_read_mib": round(med(x["disk"]["read_mib"] for x in rs), 1)}
            for extra in ("drain_s", "put_plus_drain_mib_s", "sync_s", "write_plus_sync_mib_s"):
                if extra in v:
                    summary[extra] = round(med(x[extra] for x in rs), 4)
            out[side][phase] = summary

    def ratio(a: float, b: float) -> float:
        return round(a / b, 3)
    bc, base = out["bluecached"], out["baseline"]
    pairs = {"put_vs_write": ("put", "write"), "put_vs_overwrite": ("put", "write_overwrite"),
             "get_vs_read_warm": ("get", "read_warm"),
             "get_vs_read_cold": ("get", "read_cold"),
             "get_nvme_vs_read_cold": ("get_nvme", "read_cold")}
    out["ratio"] = {k: ratio(bc[a]["mib_s"], base[b]["mib_s"]) for k, (a, b) in pairs.items()}
    out["ratio_runs"] = {k: [r["ratio"][k] for r in runs] for k in pairs}
    out["runs"] = runs
    return out


# -- output --------------------------------------------------------------------------------------

PHASES = [  # (label, side, phase) in table/plot order
    ("put", "bluecached", "put"), ("write", "baseline", "write"),
    ("overwrite", "baseline", "write_overwrite"),
    ("get", "bluecached", "get"), ("read warm", "baseline", "read_warm"),
    ("get NVMe", "bluecached", "get_nvme"), ("read cold", "baseline", "read_cold"),
]


def markdown(result: dict) -> str:
    lines = ["| clients | put | write | overwrite | put/write | put/overwrite | get (DRAM) "
             "| read warm | get/warm | get/cold | get NVMe | read cold | NVMe/cold |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        bc, base, r = p["bluecached"], p["baseline"], p["ratio"]
        lines.append(
            f"| {p['concurrency']} | {bc['put']['mib_s']:.0f} | {base['write']['mib_s']:.0f} "
            f"| {base['write_overwrite']['mib_s']:.0f} "
            f"| {r['put_vs_write']:.2f} | {r['put_vs_overwrite']:.2f} | {bc['get']['mib_s']:.0f} "
            f"| {base['read_warm']['mib_s']:.0f} | {r['get_vs_read_warm']:.2f} "
            f"| {r['get_vs_read_cold']:.2f} | {bc['get_nvme']['mib_s']:.0f} "
            f"| {base['read_cold']['mib_s']:.0f} | {r['get_nvme_vs_read_cold']:.2f} |")
    lines.append("")
    lines.append(f"MiB/s of 32 MiB objects, median of {result['config']['repeat']} runs; "
                 "ratio = bluecached / baseline (ratio of the medians).")
    return "\n".join(lines)


def plot(plt, result: dict, path: Path) -> None:
    points = result["points"]
    xs = list(range(len(points)))
    # (title, bluecached phase, [(baseline phase, legend, ratio key), ...])
    panels = [
        ("put vs write (no fsync)", "put",
         [("write", "files: write new files", "put_vs_write"),
          ("write_overwrite", "files: overwrite cached files", "put_vs_overwrite")]),
        ("get (DRAM hit) vs read (page cache warm)", "get",
         [("read_warm", "files: read, page cache warm", "get_vs_read_warm")]),
        ("get from NVMe vs read (page cache dropped)", "get_nvme",
         [("read_cold", "files: read, page cache dropped", "get_nvme_vs_read_cold")]),
    ]
    hatches = ["//", ".."]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for ax, (title, phase, bases) in zip(axes, panels, strict=True):
        series = [("bluecached", phase, f"bluecached {phase}", None)] + \
                 [("baseline", b, label, rkey) for b, label, rkey in bases]
        width = 0.8 / len(series)
        top = 1.0
        for k, (side, ph, label, rkey) in enumerate(series):
            stats = [pt[side][ph] for pt in points]
            med = [x["mib_s"] for x in stats]
            err = [[x["mib_s"] - x.get("mib_s_min", x["mib_s"]) for x in stats],
                   [x.get("mib_s_max", x["mib_s"]) - x["mib_s"] for x in stats]]
            pos = [x - 0.4 + width * (k + 0.5) for x in xs]
            style = ({"color": "#1f77b4"} if side == "bluecached" else
                     {"color": "#d0d0d0" if k == 1 else "#f0f0f0", "edgecolor": "#666666",
                      "hatch": hatches[(k - 1) % len(hatches)]})
            ax.bar(pos, med, width, yerr=err, capsize=3, label=label, **style)
            highs = [x.get("mib_s_max", x["mib_s"]) for x in stats]
            top = max(top, *highs)
            if rkey:
                for x, pt, hi in zip(pos, points, highs, strict=True):
                    ax.text(x, hi, f"×{pt['ratio'][rkey]:.2f}", ha="center", va="bottom",
                            fontsize=9, fontweight="bold")
        ax.set_ylim(0, top * 1.18)
        ax.set_xticks(xs, [f"{p['concurrency']} client{'s' if p['concurrency'] > 1 else ''}"
                           for p in points])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("MiB/s (32 MiB objects)")
        ax.legend(fontsize=8, loc="upper left")
    m = result["machine"]
    fig.suptitle(f"bluecached vs plain files — {m['cpu_model']}, {m['cores']} cores, "
                 f"{m['dir_mount']['fs_type']}, O_DIRECT "
                 f"{'on' if result['daemon'].get('o_direct') else 'off'}. Bars: median of "
                 f"{result['config']['repeat']} runs, whiskers min..max; ×r = bluecached / that "
                 f"baseline{' (quick)' if result['config']['quick'] else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes for a smoke test (and outputs to a temporary directory "
                         "unless --out-dir is given)")
    ap.add_argument("--out-dir", type=Path,
                    help="where store.json and store.png go (default docs/benchmarks, "
                         "or /tmp/bluecache-bench-quick with --quick)")
    ap.add_argument("--dir", type=Path,
                    help="work directory for the NVMe tier and the baseline files (default: a "
                         "new temporary directory under /var/tmp, removed at the end)")
    ap.add_argument("--total", default=None,
                    help="bytes per point and side, e.g. 1GiB (default 1GiB, --quick 128MiB); "
                         "rounded so every client writes the same number of 32 MiB objects")
    ap.add_argument("--concurrency", default=None,
                    help="comma-separated client counts (default 1,8,32; --quick 1,4)")
    ap.add_argument("--piece", default="32MiB",
                    help="bytes per write/read request (and per os.write/readv), default 32MiB "
                         "(one request per object)")
    ap.add_argument("--dram", default=None,
                    help="DRAM tier size (default: twice a round, at least 1GiB)")
    ap.add_argument("--nvme-size", default=None,
                    help="NVMe tier capacity (default: twice a round + 1GiB; segment files are "
                         "sparse)")
    ap.add_argument("--durability", choices=("fsync", "none"), default="fsync",
                    help="daemon durability (default fsync, the daemon's own default)")
    ap.add_argument("--o-direct", choices=("auto", "on", "off"), default="auto",
                    help="daemon tiers.nvme.o_direct (default auto, the daemon's own default)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs of every point, interleaved (1, 8, 32, 1, 8, 32, ...); the "
                         "tables show medians (default 5, --quick 1)")
    ap.add_argument("--index-files", type=int, default=None,
                    help="small files for the daemon restart measurement (default 20000, "
                         "--quick 1000; 0 skips it)")
    ap.add_argument("--index-clients", type=int, default=4,
                    help="threads creating those files (default 4)")
    ap.add_argument("--index-objects", type=int, default=None,
                    help="records for bench/index_rebuild.py (default 100000, --quick 10000; "
                         "0 skips it)")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="record a py-spy flame graph of the daemon for each bluecached phase "
                         "into DIR (slows the daemon down; not for published numbers)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="measure memory as it comes: no daemon warm-up after each start (its "
                         "DRAM pool and region mappings fault in during the first phase) and no "
                         "page-cache pre-touch before the baseline write")
    ap.add_argument("--py-spy-format", choices=("flamegraph", "raw", "speedscope"),
                    default="flamegraph", help="py-spy output format (default flamegraph: SVG)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    q = args.quick
    args.total = parse_size(args.total or ("128MiB" if q else "1GiB"))
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4" if q else "1,8,32"))
                        .split(",")]
    args.piece = parse_size(args.piece)
    if not 0 < args.piece <= OBJECT_SIZE or args.piece % 4096:
        ap.error("--piece must be a multiple of 4 KiB and at most 32 MiB")
    if args.repeat is None:
        args.repeat = 1 if q else 5
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.index_files is None:
        args.index_files = 1000 if q else 20_000
    if args.index_objects is None:
        args.index_objects = 10_000 if q else 100_000
    if args.out_dir is None:
        args.out_dir = Path("/tmp/bluecache-bench-quick") if q else ROOT / "docs" / "benchmarks"
    return args


def objects_for(total: int, concurrency: int) -> int:
    objects = max(1, round(total / OBJECT_SIZE))
    return -(-objects // concurrency) * concurrency


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    own_work = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="bcbench-", dir="/var/tmp")) if own_work else args.dir
    work.mkdir(parents=True, exist_ok=True)
    if not own_work and any(work.iterdir()):
        print(f"store_bench: {work} is not empty; give an empty --dir", file=sys.stderr)
        return 2
    rounds = {c: objects_for(args.total, c) for c in args.concurrency}
    biggest = max(rounds.values()) * OBJECT_SIZE
    dram = parse_size(args.dram) if args.dram else max(GiB, -(-2 * biggest // GiB) * GiB)
    nvme = parse_size(args.nvme_size) if args.nvme_size else 2 * biggest + GiB
    need = biggest * 2 + 512 * MiB  # one round in the NVMe tier, one as baseline files
    free = shutil.disk_usage(work).free
    if free < need:
        print(f"store_bench: {work} has {free / GiB:.1f} GiB free, needs {need / GiB:.1f}",
              file=sys.stderr)
        return 2
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    profiler = Profiler(args.py_spy, args.py_spy_format)
    notes: list[str] = []
    settings = {"tiers.dram.size": dram, "tiers.nvme.path": str(work / "daemon" / "nvme"),
                "tiers.nvme.size": nvme, "tiers.nvme.o_direct": args.o_direct,
                "durability": args.durability, "write_policy": "write-behind"}
    global DISK_STAT
    DISK_STAT = block_stat_path(work)
    result: dict = harness.run_info("store_bench", **machine_extra(work))
    result.update({
        "title": "bluecached store: put/get of 32 MiB objects vs plain files",
        "config": {"quick": args.quick, "object_bytes": OBJECT_SIZE, "piece_bytes": args.piece,
                   "total_bytes_per_point": args.total, "concurrency": args.concurrency,
                   "objects_per_point": {str(c): n for c, n in rounds.items()},
                   "client_model": "one thread per client, each with its own SyncClient, "
                                   "RegionChannel and 32 MiB SharedRegion",
                   "dram_bytes": dram, "nvme_bytes": nvme, "durability": args.durability,
                   "write_policy": "write-behind",
                   "baseline": "os.open/os.write/os.readv/os.close, no fsync, same buffers",
                   "warm_up": not args.no_warm_up, "repeat": args.repeat,
                   "o_direct_setting": args.o_direct},
    })
    print(f"store_bench: work dir {work} ({result['machine']['dir_mount']['fs_type']}), "
          f"dram {dram / GiB:.1f} GiB, points {rounds}", file=sys.stderr)
    workers: list[Worker] = []
    daemon = Daemon(work / "daemon", settings)
    try:
        start = daemon.start()
        status = daemon.call("status")
        result["daemon"] = {"o_direct": status["o_direct"], "engine": status["engine"],
                            "version": status["version"], "durability": status["durability"],
                            "write_policy": status["write_policy"], "empty_start": start,
                            "config": daemon.settings}
        workers = [Worker(i, OBJECT_SIZE) for i in range(max(args.concurrency))]
        warm = 0 if args.no_warm_up else max(len(workers), max(rounds.values()))
        result["daemon"]["warm_up"] = attach(daemon, workers, warm, args.piece)
        runs: dict[int, list[dict]] = {c: [] for c in args.concurrency}
        for r in range(args.repeat):
            for c in args.concurrency:
                t = time.perf_counter()
                point = throughput_point(daemon, workers, c, rounds[c], args.piece, warm,
                                         work / "files", profiler, notes)
                point["run"] = r + 1
                point["point_wall_s"] = round(time.perf_counter() - t, 1)
                point["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                runs[c].append(point)
                print(f"store_bench: run {r + 1}/{args.repeat}, {c:2d} client(s), {rounds[c]} "
                      "objects: " + ", ".join(f"{label} {point[side][phase]['mib_s']:.0f}"
                                              for label, side, phase in PHASES) + " MiB/s",
                      file=sys.stderr)
        result["points"] = [summarize(runs[c]) for c in args.concurrency]
        result["machine"]["loadavg_after_points"] = [round(x, 2) for x in os.getloadavg()]
        result["daemon"]["log_problems"] = daemon.log_problems()[:20]
        result["daemon"]["final_sigterm_stop_s"] = daemon.stop()
    finally:
        for w in workers:
            w.close()
        daemon.cleanup()
        shutil.rmtree(work / "daemon", ignore_errors=True)
        shutil.rmtree(work / "files", ignore_errors=True)

    try:
        index: dict = {}
        if args.index_objects:
            print(f"store_bench: bench/index_rebuild.py --objects {args.index_objects} ...",
                  file=sys.stderr)
            index["offline"] = offline_index_rebuild(args.index_objects, work, notes)
        if args.index_files:
            print(f"store_bench: daemon restart over {args.index_files} small files ...",
                  file=sys.stderr)
            index["daemon_restart"] = daemon_restart_index(
                work, args.index_files, args.index_clients,
                {**settings, "tiers.nvme.path": str(work / "index_daemon" / "nvme"),
                 "tiers.nvme.size": 2 * GiB, "tiers.dram.size": GiB}, notes)
        result["index_rebuild"] = index
    finally:
        if own_work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    result["notes"] = notes
    result["duration_s"] = round(time.perf_counter() - t_start, 1)
    table = markdown(result)
    harness.write_results(args.out_dir, "store", result, "\n".join(harness.markdown_head(
        result["title"], result, f"Work directory on {result['machine']['dir_mount']['fs_type']}"
        f"{' (quick)' if args.quick else ''}.")) + "\n" + table,
        lambda plt, path: plot(plt, result, path))

    print(table)
    idx = result.get("index_rebuild", {})
    if "offline" in idx and "total_s" in idx["offline"]:
        o = idx["offline"]
        print(f"\nindex_rebuild.py: {o['objects']} records: load {o['load_s']} s + rebuild "
              f"{o['rebuild_s']} s = {o['total_s']} s")
    if "daemon_restart" in idx:
        d = idx["daemon_restart"]
        print(f"daemon start (hello answered): empty {d['empty_start']['hello_s']} s; "
              f"{d['populate']['files']} files after SIGKILL {d['after_sigkill']['hello_s']} s, "
              f"after SIGTERM {d['after_sigterm']['hello_s']} s "
              f"(populating took {d['populate']['create_s']} s + {d['populate']['drain_s']} s "
              f"write-behind)")
    for note in notes:
        print(f"note: {note}")
    print(f"\nrun took {result['duration_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
