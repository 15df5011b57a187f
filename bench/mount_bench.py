#!/usr/bin/env python3
"""Store and load of KV block files through the bluecache FUSE mount, with llm-d's syscalls,
against tmpfs, the backing disk and libfuse's C `passthrough_ll`.

One run, for each client thread count (default 1, 8 and 64), stores max(32, threads) files of
32 MiB and loads them back on every target:

  tmpfs           a directory under /dev/shm, used directly
  backing_dir     a directory under /var/tmp (the disk that holds the NVMe tier), used directly;
                  page cache dropped before loads, so loads come from the disk
  passthrough_ll  libfuse 3.14's example/passthrough_ll.c over a tmpfs directory, built at run
                  time from Debian's source package (never committed) with its default options
  bluecache       bluecached + bluecache-hostd as processes (bench/harness.py), the cache
                  mounted; loads come from the DRAM tier
  bluecache_nvme  (load only) the same files after bluecached was restarted (SIGTERM + start,
                  hostd reconnects by itself) and the page cache dropped: every file is promoted
                  from the NVMe tier with its CRC32C checked

Store = tests/connectors.llmd_write: open(dst, O_RDONLY) -> ENOENT, stat walk + mkdir of the
missing levels, open(tmp, O_WRONLY|O_CREAT|O_TRUNC), ONE writev of the whole file, rename(tmp, dst)
while the fd is open, close. Load = the sequence of tests/connectors.llmd_read (open, lseek END,
lseek SET, read loop in pieces of at most 8 MiB, close), but reading into the caller's
page-aligned buffer, as the C++ backend does with its pinned staging memory; Python's os.read
would return fresh unaligned bytes and copy them twice more. Every thread stores and loads its own
files; every load checks length and the first and last 4 KiB in the timed loop, and after the
timer stops every file is compared byte for byte with what was written (read buffers are zeroed
before each load phase). Each (store, load) pair is repeated --reps times; tables show the median.

It also measures os.path.exists rates (single thread, 20k calls) for present and absent block names
on the mount, on tmpfs and on passthrough_ll, and then profiles hostd and bluecached with py-spy
while 8 threads store and load through the mount.

    /tmp/venv/bin/python bench/mount_bench.py          # -> docs/benchmarks/mount.{json,png,md}
    /tmp/venv/bin/python bench/mount_bench.py --quick  # -> /tmp/bluecache-mount-bench-quick/

Needs root (mounts, drop_caches, apt-get source). See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import glob
import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import yaml
from harness import (
    Bluecached,
    CpuMeter,
    GiB,
    Hostd,
    KiB,
    MiB,
    drop_caches,
    force_unmount,
    is_mounted,
    other_busy_processes,
)

ROOT = harness.ROOT
# The connectors' syscall sequences are shared with the mount tests: found in tests/, by path.
sys.path.append(str(ROOT / "tests"))
from connectors import block_name, llmd_write  # noqa: E402

READ_PIECE = 8 * MiB          # what tests/connectors.llmd_read asks per read()
EDGE = 4 * KiB                # cheap check: first and last 4 KiB + length
PHASE_TIMEOUT = 900           # a phase that takes longer than this is a hang
TARGETS = ("tmpfs", "backing_dir", "passthrough_ll", "bluecache")
LABELS = {"tmpfs": "tmpfs direct", "backing_dir": "backing dir (disk; loads cold)",
          "passthrough_ll": "passthrough_ll (C) over tmpfs", "bluecache": "bluecache (DRAM)",
          "bluecache_nvme": "bluecache after restart (NVMe)"}
ANALYSIS_MARK = "<!-- analysis: kept when the benchmark rewrites this file -->"


# -- machine and process accounting --------------------------------------------------------------


def fs_type(path: Path) -> str:
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(path)],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def versions() -> dict:
    import pyfuse3
    import trio
    import zmq
    out = {"python": platform.python_version(), "pyfuse3": pyfuse3.__version__,
           "trio": trio.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
    r = subprocess.run(["pkg-config", "--modversion", "fuse3"], capture_output=True, text=True)
    out["libfuse_pkgconfig"] = r.stdout.strip() or None
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "libfuse3-3"],
                       capture_output=True, text=True)
    out["libfuse3_deb"] = r.stdout.strip() or None
    r = subprocess.run(["fusermount3", "--version"], capture_output=True, text=True)
    out["fusermount3"] = (r.stdout + r.stderr).strip() or None
    return out


# -- libfuse's passthrough_ll, built from Debian's source package -------------------------------


def build_passthrough_ll(build_dir: Path) -> dict:
    """apt-get source fuse3 + gcc. Returns {"ok": True, "binary": ...} or {"ok": False, ...}."""
    log: list[str] = []
    info: dict = {"ok": False, "log": log}
    sources_dir = Path("/etc/apt/sources.list.d")
    main_sources = sources_dir / "debian.sources"
    added: Path | None = None

    def step(name, cmd, **kw):
        r = subprocess.run(cmd, capture_output=True, text=True, **kw)
        log.append(f"$ {' '.join(cmd)} -> {r.returncode}")
        if r.returncode != 0:
            raise RuntimeError(f"{name} failed ({r.returncode}): "
                               + (r.stderr or r.stdout).strip()[-800:])
        return r

    try:
        have_src = any("deb-src" in p.read_text(errors="replace")
                       for p in sources_dir.glob("*.sources"))
        if not have_src:
            if not main_sources.exists():
                raise RuntimeError(f"{main_sources} is missing: no entry to twin")
            # The twin of the first stanza (the main archive), with Types: deb-src.
            stanza = main_sources.read_text().strip().split("\n\n")[0]
            twin = re.sub(r"^Types:.*$", "Types: deb-src", stanza, count=1, flags=re.M)
            added = sources_dir / "bluecache-bench-deb-src.sources"
            added.write_text(twin + "\n")
            info["deb_src_entry_added"] = str(added)
        step("apt-get update", ["apt-get", "update", "-q"])
        step("apt-get source", ["apt-get", "source", "-q", "fuse3"], cwd=build_dir)
        found = sorted(glob.glob(str(build_dir / "fuse3-*" / "example" / "passthrough_ll.c")))
        if not found:
            raise RuntimeError("example/passthrough_ll.c not in the unpacked source")
        src = Path(found[-1])
        info["source"] = src.parents[1].name
        flags = step("pkg-config", ["pkg-config", "--cflags", "--libs", "fuse3"]).stdout.split()
        binary = build_dir / "passthrough_ll"
        step("gcc", ["gcc", "-Wall", "-O2", "-o", str(binary), str(src), *flags])
        info["compile"] = f"gcc -Wall -O2 {src.name} {' '.join(flags)}"
        info["help"] = subprocess.run([str(binary), "--help"], capture_output=True,
                                      text=True).stdout.strip()
        info.update(ok=True, binary=str(binary))
    except (RuntimeError, OSError) as e:
        info["error"] = str(e)
    finally:
        if added is not None:
            added.unlink(missing_ok=True)
            info["deb_src_entry_removed_after_build"] = True
    return info


class PassthroughLL:
    def __init__(self, binary: str, source: Path, mnt: Path, log: Path):
        self.binary, self.source, self.mnt, self.log = binary, source, mnt, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20) -> PassthroughLL:
        self.source.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-f", "-o", f"source={self.source}", str(self.mnt)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError(f"passthrough_ll exited with {self.proc.returncode}: "
                                   + self.log.read_text()[-500:])
            if time.monotonic() > deadline:
                raise RuntimeError("passthrough_ll did not mount")
            time.sleep(0.05)
        return self

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        if self.proc is None:
            return
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        force_unmount(self.mnt)


# -- block files ---------------------------------------------------------------------------------


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # anonymous maps are page aligned


def fill_block(buf: mmap.mmap, base: bytes, file_id: int) -> None:
    """Random bytes shared by all files, made unique per file: a digest-derived first and last
    4 KiB, and (file_id, chunk) stamped at the start of every 1 MiB."""
    size = len(buf)
    buf[:] = base[:size]
    for off in range(0, size, MiB):
        buf[off:off + 16] = struct.pack("<QQ", file_id, off // MiB)
    head = hashlib.shake_256(f"head:{file_id}".encode()).digest(EDGE)
    tail = hashlib.shake_256(f"tail:{file_id}".encode()).digest(EDGE)
    buf[:EDGE] = head
    buf[size - EDGE:] = tail


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def same_bytes(a: mmap.mmap, b: mmap.mmap) -> bool:
    """Byte-for-byte equality of two maps with libc's memcmp (a Python compare of 32 MiB
    memoryviews takes ~0.1 s)."""
    if len(a) != len(b):
        return False
    pa = ctypes.addressof(ctypes.c_char.from_buffer(a))
    pb = ctypes.addressof(ctypes.c_char.from_buffer(b))
    return _memcmp(pa, pb, len(a)) == 0


def llmd_read_into(root: str, rel: str, buf: memoryview) -> int:
    """tests/connectors.llmd_read's syscalls (open, lseek END, lseek SET, read loop, close) into
    a caller's page-aligned buffer. readv with one iovec is read(2)."""
    fd = os.open(os.path.join(root, rel), os.O_RDONLY)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        if size > len(buf):
            raise OSError(f"{rel}: {size} bytes, buffer {len(buf)}")
        done = 0
        while done < size:
            n = os.readv(fd, [buf[done:min(size, done + READ_PIECE)]])
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


class Dataset:
    """The files of one point: page-aligned write buffers (the expected content) and read
    buffers, one of each per file, so loads can be fully verified after the timer stops."""

    def __init__(self, files: int, size: int, first_id: int, base: bytes):
        self.size = size
        self.ids = list(range(first_id, first_id + files))
        self.names = [block_name(i) for i in self.ids]
        self.wbufs = []
        self.rbufs = []
        for fid in self.ids:
            w = aligned(size)
            fill_block(w, base, fid)
            self.wbufs.append(w)
            r = aligned(size)
            r.write(bytes(size))  # fault the pages in now, not in the timed load
            self.rbufs.append(r)

    def clear_reads(self) -> None:
        zeros = bytes(self.size)
        for r in self.rbufs:
            r[:] = zeros

    def verify_all(self) -> dict:
        bad = [self.names[i] for i, (w, r) in enumerate(zip(self.wbufs, self.rbufs, strict=True))
               if not same_bytes(w, r)]
        return {"files_verified": len(self.wbufs) - len(bad), "mismatches": bad[:5]}

    def close(self) -> None:
        for b in self.wbufs + self.rbufs:
            b.close()


def run_threads(threads: int, work, files: int) -> dict:
    """Runs work(t, i) for every file i on thread t = i % threads; returns wall seconds and the
    slowest/fastest thread."""
    errors: list[BaseException] = []
    per_thread: list[float] = [0.0] * threads
    barrier = threading.Barrier(threads + 1)

    def body(t: int) -> None:
        try:
            barrier.wait()
            t0 = time.perf_counter()
            for i in range(t, files, threads):
                work(t, i)
            per_thread[t] = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    pool = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    deadline = time.monotonic() + PHASE_TIMEOUT
    for th in pool:
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            raise TimeoutError(f"a phase with {threads} threads took over {PHASE_TIMEOUT}s")
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"seconds": wall, "thread_min_s": min(per_thread), "thread_max_s": max(per_thread)}


def store_phase(root: Path, data: Dataset, threads: int) -> dict:
    found = []

    def work(t, i):
        if not llmd_write(str(root), data.names[i], memoryview(data.wbufs[i]), f"t{t}"):
            found.append(data.names[i])

    r = run_threads(threads, work, len(data.names))
    if found:
        raise RuntimeError(f"store found {len(found)} blocks already present: {found[0]}")
    return r


def load_phase(root: Path, data: Dataset, threads: int) -> dict:
    bad = []
    size = data.size

    def work(t, i):
        w, r = memoryview(data.wbufs[i]), memoryview(data.rbufs[i])
        n = llmd_read_into(str(root), data.names[i], r)
        if n != size or r[:EDGE] != w[:EDGE] or r[size - EDGE:] != w[size - EDGE:]:
            bad.append((data.names[i], n))

    r = run_threads(threads, work, len(data.names))
    r["cheap_check_failures"] = len(bad)
    if bad:
        r["cheap_check_examples"] = [f"{n}: {got} bytes" for n, got in bad[:3]]
    return r


def mib_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / MiB / seconds, 1) if seconds > 0 else 0.0


# -- bluecache stack -----------------------------------------------------------------------------


class Bluecache:
    def __init__(self, root: Path, mnt: Path, settings: dict, hostd_settings: dict | None = None):
        self.settings = settings
        self.hostd_settings = hostd_settings or {}
        self.daemon = Bluecached(root, **settings)
        self.mnt = mnt
        self.hostd: Hostd | None = None

    def start(self) -> None:
        self.daemon.start()
        self.hostd = Hostd(self.daemon, self.mnt, **self.hostd_settings).start()

    @property
    def pids(self) -> dict:
        return {"bluecached": self.daemon.proc.pid if self.daemon.proc else None,
                "hostd": self.hostd.proc.pid if self.hostd and self.hostd.proc else None}

    def stats(self) -> dict:
        client = self.daemon.client(timeout=30)
        try:
            return client.call("stats")
        finally:
            client.close()

    def wait(self, done, timeout: float = 300, what: str = "") -> float:
        """Polls stats until done(stats); returns seconds waited."""
        t0 = time.perf_counter()
        while True:
            s = self.stats()
            if done(s):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"bluecache: {what} not reached in {timeout}s: {s}")
            time.sleep(0.05)

    def wait_written_behind(self) -> float:
        return self.wait(lambda s: s["dirty_bytes"] == 0, what="write-behind drained")

    def wait_empty(self) -> float:
        return self.wait(lambda s: s["files"] == 0 and s["tiers"]["dram"]["bytes"] == 0
                         and s["tiers"]["nvme"]["bytes"] == 0, timeout=60, what="empty cache")

    def restart_daemon(self) -> dict:
        """SIGTERM bluecached (it writes everything behind and checkpoints), start it again and
        wait until hostd has reconnected and the mount answers."""
        restarted_before = self.hostd.log.read_text().count("it restarted")
        t0 = time.perf_counter()
        status = self.daemon.stop()
        stopped = time.perf_counter()
        self.daemon.start()
        ready = time.perf_counter()
        deadline = time.monotonic() + 60
        while self.hostd.log.read_text().count("it restarted") <= restarted_before:
            if time.monotonic() > deadline:
                raise TimeoutError("hostd did not reconnect to the restarted bluecached")
            time.sleep(0.05)
        while True:  # a stat through the mount, then a readdir the kernel cannot answer itself
            try:
                os.stat(self.mnt)
                os.listdir(self.mnt)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        answered = time.perf_counter()
        return {"exit_status": status, "stop_s": round(stopped - t0, 3),
                "start_to_ready_s": round(ready - stopped, 3),
                "ready_to_mount_answers_s": round(answered - ready, 3)}

    def stop(self) -> None:
        """hostd, then bluecached: each SIGTERM, then SIGKILL if it hangs."""
        try:
            if self.hostd is not None:
                self.hostd.stop(timeout=30)
        finally:
            force_unmount(self.mnt)
            self.daemon.stop(timeout=120)


def tier_counters(s: dict) -> dict:
    d, n = s["tiers"]["dram"], s["tiers"].get("nvme", {})
    return {"dram_hits": d["hits"], "dram_misses": d["misses"], "nvme_hits": n.get("hits", 0),
            "dram_evictions": d["evictions"], "nvme_bytes_in": n.get("bytes_in", 0),
            "requests": s["requests"], "checksum_failures": s["checksum_failures"]}


def counters_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# -- one point -----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, work: Path, shm: Path, notes: list[str]):
        self.args = args
        self.work, self.shm = work, shm
        self.notes = notes
        self.dirs = {"tmpfs": shm / "direct", "backing_dir": work / "backing",
                     "passthrough_ll": work / "mnt-ptll", "bluecache": work / "mnt-bc"}
        self.bc: Bluecache | None = None
        self.ptll: PassthroughLL | None = None

    def pids(self) -> dict:
        out = dict(self.bc.pids) if self.bc else {}
        out["passthrough_ll"] = self.ptll.pid if self.ptll else None
        return out

    def targets(self) -> list[str]:
        return [t for t in TARGETS if t != "passthrough_ll" or self.ptll is not None]

    def clean(self, target: str) -> dict:
        root = self.dirs[target]
        out = {}
        t0 = time.perf_counter()
        for entry in list(root.iterdir()):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        out["remove_s"] = round(time.perf_counter() - t0, 3)
        if target == "bluecache":
            drop_caches()   # the kernel forgets the unlinked inodes: bluecached frees them
            out["freed_s"] = round(self.bc.wait_empty(), 3)
        return out

    def point(self, threads: int, files: int, size: int, first_id: int, base: bytes) -> dict:
        """Repetitions are interleaved (rep 1 of every target, then rep 2, ...) so that load from
        other processes on the machine falls on all targets alike."""
        data = Dataset(files, size, first_id, base)
        nbytes = files * size
        res: dict = {"threads": threads, "files": files, "file_bytes": size, "bytes": nbytes,
                     "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
                     "targets": {}}
        reps: dict[str, list] = {t: [] for t in self.targets()}
        reps["bluecache_nvme"] = []
        try:
            for rep in range(self.args.reps):
                for target in self.targets():
                    r = self.one_rep(target, data, threads)
                    line = (f"  rep {rep + 1} {target:15s} store "
                            f"{mib_s(nbytes, r['store']['seconds']):8.1f} MiB/s  load "
                            f"{mib_s(nbytes, r['load']['seconds']):8.1f} MiB/s")
                    if "nvme" in r:
                        nv = r.pop("nvme")
                        reps["bluecache_nvme"].append(nv)
                        line += f"  load after restart (NVMe) {nv['load_mib_s']:8.1f} MiB/s"
                    reps[target].append(r)
                    print(line, flush=True)
        finally:
            data.close()
        for target, rs in reps.items():
            if not rs:
                continue
            if target == "bluecache_nvme":
                load = [r["load_mib_s"] for r in rs]
                res["targets"][target] = {"load_mib_s": round(statistics.median(load), 1),
                                          "load_mib_s_reps": load, "reps": rs}
                continue
            store = [mib_s(nbytes, r["store"]["seconds"]) for r in rs]
            load = [mib_s(nbytes, r["load"]["seconds"]) for r in rs]
            res["targets"][target] = {"store_mib_s": round(statistics.median(store), 1),
                                      "load_mib_s": round(statistics.median(load), 1),
                                      "store_mib_s_reps": store, "load_mib_s_reps": load,
                                      "reps": rs}
        res["ratios"] = ratios(res["targets"])
        return res

    def one_rep(self, target: str, data: Dataset, threads: int) -> dict:
        """Store, (sync | write-behind drain), drop caches, load, verify; for bluecache also a
        load after a bluecached restart; then remove the files."""
        root = self.dirs[target]
        r: dict = {"loadavg": Path("/proc/loadavg").read_text().split()[0]}
        before = tier_counters(self.bc.stats()) if target == "bluecache" else None
        with CpuMeter(self.pids()) as m:
            r["store"] = store_phase(root, data, threads)
        r["store"].update(m.result)
        if target == "backing_dir":
            t0 = time.perf_counter()
            os.sync()
            r["sync_after_store_s"] = round(time.perf_counter() - t0, 3)
        if target == "bluecache":
            with CpuMeter(self.pids()) as m:
                r["write_behind_drain_s"] = round(self.bc.wait_written_behind(), 3)
            r["write_behind_cpu"] = m.result
        data.clear_reads()
        failed = drop_caches()
        if failed:
            r["drop_caches_error"] = failed
        with CpuMeter(self.pids()) as m:
            r["load"] = load_phase(root, data, threads)
        r["load"].update(m.result)
        r["load"]["verify"] = data.verify_all()
        check(r, target, threads)
        if target == "bluecache":
            r["tiers"] = counters_delta(tier_counters(self.bc.stats()), before)
            r["nvme"] = self.nvme_load(data, threads)
        r["clean"] = self.clean(target)
        return r

    def nvme_load(self, data: Dataset, threads: int) -> dict:
        restart = self.bc.restart_daemon()
        before = tier_counters(self.bc.stats())
        data.clear_reads()
        failed = drop_caches()
        with CpuMeter(self.pids()) as m:
            load = load_phase(self.dirs["bluecache"], data, threads)
        load.update(m.result)
        load["verify"] = data.verify_all()
        tiers = counters_delta(tier_counters(self.bc.stats()), before)
        out = {"load_mib_s": mib_s(len(data.names) * data.size, load["seconds"]), "load": load,
               "restart": restart, "tiers": tiers}
        if failed:
            out["drop_caches_error"] = failed
        if tiers["nvme_hits"] != len(data.names):
            out["warning"] = (f"{tiers['nvme_hits']} NVMe hits for {len(data.names)} files: "
                              "not every load came from NVMe")
        if load["cheap_check_failures"] or load["verify"]["mismatches"]:
            raise RuntimeError(f"bluecache_nvme: wrong bytes after restart: {load}")
        return out


def check(r: dict, target: str, threads: int) -> None:
    load = r["load"]
    if load["cheap_check_failures"] or load["verify"]["mismatches"]:
        raise RuntimeError(f"{target} at {threads} threads served wrong bytes: "
                           f"{load.get('cheap_check_examples')} {load['verify']}")


def ratios(t: dict) -> dict:
    def q(a, b):
        return round(a / b, 3) if a and b else None
    bc = t.get("bluecache", {})
    out = {}
    for other in ("passthrough_ll", "tmpfs", "backing_dir"):
        if other in t:
            out[f"store_vs_{other}"] = q(bc.get("store_mib_s"), t[other]["store_mib_s"])
            out[f"load_vs_{other}"] = q(bc.get("load_mib_s"), t[other]["load_mib_s"])
    if "backing_dir" in t and "bluecache_nvme" in t:
        out["load_nvme_vs_backing_dir"] = q(t["bluecache_nvme"]["load_mib_s"],
                                            t["backing_dir"]["load_mib_s"])
    return out


# -- os.path.exists ------------------------------------------------------------------------------


EXISTS_KINDS = ("present_cold", "present", "absent", "absent_in_existing_dirs")


def exists_rates(bench: Bench, calls: int, present_count: int, first_id: int) -> dict:
    """os.path.exists, one thread. The present names are written (4 KiB blocks, llmd_write),
    then the page/dentry caches dropped: `present_cold` asks each name once (the kernel must ask
    the file system), `present` then cycles `calls` times over them (cached: FUSE entries are
    trusted 60 s on the mount, 1 s on passthrough_ll)."""
    present = [block_name(first_id + i) for i in range(present_count)]
    absent = [block_name(first_id + 1_000_000 + i) for i in range(calls)]
    absent_dirs = [os.path.join(os.path.dirname(present[i % present_count]),
                                hashlib.sha256(f"absent:{i}".encode()).hexdigest() + ".bin")
                   for i in range(calls)]
    payload = aligned(4 * KiB)
    out: dict = {"calls": calls, "present_names": present_count,
                 "kinds": {
                     "present_cold": f"each of the {present_count} written names once, right "
                                     "after sync + echo 3 > drop_caches",
                     "present": f"{calls} calls cycling over the written names "
                                "(kernel caches warm)",
                     "absent": f"{calls} distinct block names never written (their hash "
                               "directories mostly absent too, as for a scheduler's lookups)",
                     "absent_in_existing_dirs": f"{calls} distinct never-written names in the "
                                                "leaf directories of the written ones"},
                 "targets": {}}
    try:
        for target in ("tmpfs", "passthrough_ll", "bluecache"):
            if target not in bench.targets():
                continue
            root = str(bench.dirs[target])
            t0 = time.perf_counter()
            for name in present:
                llmd_write(root, name, payload, "x")
            rates = {"small_store_files_s": round(present_count / (time.perf_counter() - t0))}
            if target == "bluecache":
                bench.bc.wait_written_behind()
            drop_caches()
            for kind, names, n in (("present_cold", present, present_count),
                                   ("present", present, calls), ("absent", absent, calls),
                                   ("absent_in_existing_dirs", absent_dirs, calls)):
                paths = [os.path.join(root, names[i % len(names)]) for i in range(n)]
                t0 = time.perf_counter()
                got = sum(map(os.path.exists, paths))
                dt = time.perf_counter() - t0
                if got != (n if kind.startswith("present") else 0):
                    raise RuntimeError(f"exists on {target} ({kind}): {got} of {n} true")
                rates[kind] = round(n / dt)
            out["targets"][target] = rates
            bench.clean(target)
    finally:
        payload.close()
    t = out["targets"]
    if "bluecache" in t:
        for other in ("tmpfs", "passthrough_ll"):
            if other in t:
                out[f"ratio_vs_{other}"] = {k: round(t["bluecache"][k] / t[other][k], 3)
                                            for k in t["bluecache"]}
    return out


# -- per-request cost and warm-up -------------------------------------------------------------


def request_latency(bench: Bench, calls: int) -> dict:
    """Microseconds per round trip: a bare protocol ping to bluecached (zmq, no FUSE), and
    statvfs, which FUSE never caches (kernel -> server -> kernel; on the mount also hostd ->
    bluecached), on each target."""
    out: dict = {"calls": calls}
    client = bench.bc.daemon.client()
    try:
        for _ in range(50):
            client.call("ping")
        t0 = time.perf_counter()
        for _ in range(calls):
            client.call("ping")
        out["bluecached_ping_us"] = round((time.perf_counter() - t0) / calls * 1e6, 1)
    finally:
        client.close()
    for target in ("tmpfs", "passthrough_ll", "bluecache"):
        if target not in bench.targets():
            continue
        root = str(bench.dirs[target])
        for _ in range(50):
            os.statvfs(root)
        t0 = time.perf_counter()
        for _ in range(calls):
            os.statvfs(root)
        out[f"statvfs_{target}_us"] = round((time.perf_counter() - t0) / calls * 1e6, 1)
    return out


def warm_up(bench: Bench, files: int, size: int, base: bytes) -> dict:
    """One untimed store + load + remove of the largest point's files through the mount, so that
    bluecached's DRAM pool has faulted in its chunks (a fresh daemon pays ~1 ms per MiB of page
    faults on first use; freed chunks are kept and reused)."""
    data = Dataset(files, size, 990_000, base)
    try:
        with CpuMeter(bench.pids()) as m:
            st = store_phase(bench.dirs["bluecache"], data, min(8, files))
        store = m.result
        bench.bc.wait_written_behind()
        ld = load_phase(bench.dirs["bluecache"], data, min(8, files))
        bench.clean("bluecache")
    finally:
        data.close()
    return {"files": files, "store_mib_s": mib_s(files * size, st["seconds"]),
            "load_mib_s": mib_s(files * size, ld["seconds"]),
            "bluecached_minor_faults_in_store": store["minor_faults"].get("bluecached")}


# -- profile -------------------------------------------------------------------------------------


# Leaf frames where a thread waits rather than works: a trio worker thread waiting for a job,
# and the trio loop in epoll_wait. py-spy still samples some of them (the thread was runnable at
# that instant), so they are reported apart and left out of the shares.
WAIT_LEAVES = ("WorkerThread._work ", "EpollIOManager.get_events ")


def parse_raw(path: Path) -> dict:
    """py-spy raw output (one 'thread (id): name;frame;...;frame count' line per stack, root
    first) -> top functions by self and inclusive share of the working samples."""
    self_count: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = waiting = 0
    if not path.exists():
        return {"samples": 0}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        name = "?"
        if frames[0].startswith("thread ("):
            name = frames[0].split(": ", 1)[-1] if ": " in frames[0] else frames[0]
            frames = frames[1:]
        if not frames:
            continue
        if frames[-1].startswith(WAIT_LEAVES):
            waiting += n
            continue
        threads[name[:60]] += n
        total += n
        self_count[frames[-1]] += n
        for f in set(frames):
            incl[f] += n

    def top(c, k):
        return [{"function": f, "share": round(n / total, 4), "samples": n}
                for f, n in c.most_common(k)] if total else []
    return {"samples": total, "waiting_samples": waiting, "threads": dict(threads),
            "top_self": top(self_count, 15), "top_inclusive": top(incl, 30)}


def profile(bench: Bench, seconds: float, threads: int, files: int, size: int, first_id: int,
            base: bytes, out_dir: Path) -> dict:
    """py-spy record on hostd and bluecached while `threads` threads store (rounds of store +
    remove) and then load (the same files over and over) through the mount."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(pyspy):
        return {"error": "py-spy not found (pip install py-spy into the venv)"}
    data = Dataset(files, size, first_id, base)
    root = bench.dirs["bluecache"]
    result: dict = {"threads": threads, "files": files, "file_bytes": size, "seconds": seconds,
                    "rate_hz": 100,
                    "tool": subprocess.run([pyspy, "--version"], capture_output=True,
                                           text=True).stdout.strip()}
    try:
        for phase in ("store", "load"):
            if phase == "load":
                store_phase(root, data, threads)
                bench.bc.wait_written_behind()
            spies = {}
            for proc, pid in bench.bc.pids.items():
                raw = out_dir / f"pyspy-{phase}-{proc}.txt"
                spies[proc] = (raw, subprocess.Popen(
                    [pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                     "--rate", "100", "--format", "raw", "--nolineno", "--threads",
                     "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            time.sleep(1.0)   # py-spy attaches
            rounds = 0
            moved = 0
            t0 = time.perf_counter()
            with CpuMeter(bench.pids()) as m:
                while any(p.poll() is None for _, p in spies.values()):
                    if phase == "store":
                        store_phase(root, data, threads)
                        moved += files * size
                        bench.clean("bluecache")
                    else:
                        data.clear_reads()
                        r = load_phase(root, data, threads)
                        if r["cheap_check_failures"]:
                            raise RuntimeError(f"profile load: wrong bytes {r}")
                        moved += files * size
                    rounds += 1
                    if time.perf_counter() - t0 > seconds + 60:
                        break
            ph = {"rounds": rounds, "mib_s_while_sampled": mib_s(moved, m.result["wall_s"]),
                  "cpu": m.result}
            for proc, (raw, p) in spies.items():
                try:
                    _, err = p.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    _, err = p.communicate()
                ph[proc] = parse_raw(raw)
                if p.returncode:
                    ph[proc]["py_spy_error"] = err.decode(errors="replace")[-400:]
            result[phase] = ph
            print(f"  profile {phase}: {rounds} rounds, {ph['mib_s_while_sampled']} MiB/s while "
                  f"sampled", flush=True)
        bench.clean("bluecache")
    finally:
        data.close()
    return result


# -- outputs -------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    plt = harness.pyplot()
    if plt is None:
        return
    points = results["points"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, phase in zip(axes, ("store", "load"), strict=True):
        series = [t for t in (*TARGETS, "bluecache_nvme") if any(t in p["targets"] for p in points)
                  and (phase == "load" or t != "bluecache_nvme")]
        width = 0.8 / len(series)
        for k, target in enumerate(series):
            xs, ys = [], []
            for j, p in enumerate(points):
                t = p["targets"].get(target)
                if t:
                    xs.append(j + (k - (len(series) - 1) / 2) * width)
                    ys.append(t[f"{phase}_mib_s"])
            bars = ax.bar(xs, ys, width, label=LABELS[target])
            for b, y in zip(bars, ys, strict=True):
                ax.annotate(f"{y:.0f}", (b.get_x() + b.get_width() / 2, y), ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks(range(len(points)), [f"{p['threads']} threads\n{p['files']} × "
                                           f"{p['file_bytes'] // MiB} MiB" for p in points])
        ax.set_ylabel("MiB/s (median of reps)")
        seq = "llmd_write" if phase == "store" else "llmd_read"
        ax.set_title(f"{phase} (llm-d {seq} sequence)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"bluecache mount vs tmpfs, disk and passthrough_ll — {m['cpu_model']}, "
                 f"{m['cores']} cores, kernel {m['kernel']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(x) -> str:
    return "—" if x is None else (f"{x:.2f}" if isinstance(x, float) and x < 10 else f"{x:,.0f}")


def verdicts(results: dict) -> list[dict]:
    out = []
    for p in results["points"]:
        r = p["ratios"]
        for key, goal in (("store_vs_passthrough_ll", 1.0), ("load_vs_passthrough_ll", 1.0),
                          ("store_vs_tmpfs", 0.5)):
            v = r.get(key)
            out.append({"threads": p["threads"], "ratio": key, "goal": goal, "value": v,
                        "met": None if v is None else v >= goal})
    return out


def profile_md(prof: dict) -> list[str]:
    lines = []
    if not prof or "error" in prof:
        return [f"Profile not taken: {prof.get('error') if prof else 'skipped'}", ""]
    lines.append(f"py-spy ({prof['tool']}) at {prof['rate_hz']} Hz for {prof['seconds']} s per "
                 f"phase on each daemon, {prof['threads']} threads, {prof['files']} × "
                 f"{prof['file_bytes'] // MiB} MiB. Store rounds are store + remove; load rounds "
                 "read the same files again (DRAM hits). Shares are of the working samples: "
                 "samples of a thread waiting (an idle trio worker thread, the trio loop in "
                 "epoll_wait) are counted apart and left out. Without --native, time in C "
                 "(pyfuse3's Cython handlers, libzmq, libc) is charged to the Python frame that "
                 "called it.")
    lines.append("")
    for phase in ("store", "load"):
        ph = prof.get(phase)
        if not ph:
            continue
        cpu = ph["cpu"]["cpu_s"]
        wall = ph["cpu"]["wall_s"]
        lines.append(f"**{phase}** ({ph['mib_s_while_sampled']} MiB/s while sampled; CPU over "
                     f"{wall:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in cpu.items())
                     + f"; machine busy {ph['cpu'].get('machine_busy', 0):.0%})")
        lines.append("")
        for proc in ("hostd", "bluecached"):
            s = ph.get(proc, {})
            if not s.get("samples"):
                lines.append(f"- {proc}: no samples {s.get('py_spy_error', '')}")
                continue
            thr = ", ".join(f"{k.split(' (')[0]}: {v}" for k, v in s["threads"].items())
            lines.append(f"- {proc} — {s['samples']} working samples ({thr}; "
                         f"{s['waiting_samples']} waiting samples left out)")
            lines.append("  - self: " + "; ".join(f"`{f['function']}` {f['share']:.0%}"
                                                   for f in s["top_self"][:8]))
            mine = [f for f in s["top_inclusive"]
                    if re.search(r"\((bluecached|hostd|fusefs)/|_pyfuse3", f["function"])
                    and not f["function"].startswith(("<module>", "main "))]
            lines.append("  - inclusive (project frames): " + "; ".join(
                f"`{f['function']}` {f['share']:.0%}" for f in mine[:8]))
        lines.append("")
    return lines


def interference(point: dict) -> float:
    other = wall = 0.0
    for t in point["targets"].values():
        for r in t["reps"]:
            for phase in ("store", "load"):
                ph = r.get(phase)
                if isinstance(ph, dict) and "other_cpu_s" in ph:
                    other += ph["other_cpu_s"]
                    wall += ph["wall_s"]
    return other / wall if wall else 0.0


def write_md(results: dict, path: Path) -> None:
    m = results["machine"]
    points = results["points"]
    old_analysis = ""
    if path.exists():
        text = path.read_text()
        if ANALYSIS_MARK in text:
            old_analysis = text[text.index(ANALYSIS_MARK):]
    L = ["# Mount benchmark: llm-d block store/load through bluecache", "",
         f"Run {results['created']} ({results['duration_s']:.0f} s), "
         f"`{' '.join(results['command'])}`; commit {results['git']['commit']}"
         + (" with local changes" if results["git"]["tracked_changes"] else "") + "; daemon "
         f"sources sha256 {results['git']['daemon_sources_sha256'][:16]}…"
         + (f" (uncommitted: {', '.join(results['git']['daemon_sources_changed'])})"
            if results["git"]["daemon_sources_changed"] else "") + ".", "",
         f"Machine: {m['cpu_model']}, {m['cores']} cores, "
         f"{m['memory_bytes'] / GiB:.0f} GiB, kernel {m['kernel']}, {m['platform']}; "
         f"Python {m['python']}, pyfuse3 {m['pyfuse3']}, libfuse {m['libfuse_pkgconfig']} "
         f"(deb {m['libfuse3_deb']}), trio {m['trio']}, pyzmq {m['pyzmq']}.", "",
         f"Each point: every thread stores its own {points[0]['file_bytes'] // MiB} MiB files "
         "with the llm-d sequence "
         "(`llmd_write`: probe, mkdirs, tmp create, one `writev`, rename while open, close), then "
         "loads them (`open`, `lseek END`, `lseek SET`, read loop into a page-aligned buffer, "
         "`close`). Page cache dropped (`echo 3`) before each load; every loaded byte compared "
         f"with what was written. Median of {results['config']['reps']} repetitions, interleaved "
         "across targets. "
         "Raw numbers: [mount.json](mount.json).", "",
         "![store and load MiB/s](mount.png)", "",
         "## MiB/s", "",
         "| threads | files | " + " | ".join(f"{LABELS[t]} store" for t in TARGETS
                                             if t in points[0]["targets"])
         + " | " + " | ".join(f"{LABELS[t]} load" for t in (*TARGETS, "bluecache_nvme")
                              if t in points[0]["targets"]) + " |",
         "|" + "---|" * (2 + sum(t in points[0]["targets"] for t in TARGETS) * 2
                         + ("bluecache_nvme" in points[0]["targets"]))]
    for p in points:
        t = p["targets"]
        L.append(f"| {p['threads']} | {p['files']} × {p['file_bytes'] // MiB} MiB | "
                 + " | ".join(fmt(t[x]["store_mib_s"]) for x in TARGETS if x in t) + " | "
                 + " | ".join(fmt(t[x]["load_mib_s"]) for x in (*TARGETS, "bluecache_nvme")
                              if x in t) + " |")
    L += ["", "Other processes on the machine during the timed phases (CPU seconds they used ÷ "
          "wall seconds, on 2 cores): " + "; ".join(
              f"{p['threads']} threads {interference(p):.2f} cores" for p in points) + ".",
          "", "## Ratios (bluecache ÷ target)", "",
          "| threads | store ÷ passthrough_ll | load ÷ passthrough_ll | store ÷ tmpfs | "
          "load ÷ tmpfs | store ÷ backing dir | load (DRAM) ÷ backing dir (cold) | "
          "load after restart (NVMe) ÷ backing dir (cold) |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        r = p["ratios"]
        L.append(f"| {p['threads']} | " + " | ".join(fmt(r.get(k)) for k in (
            "store_vs_passthrough_ll", "load_vs_passthrough_ll", "store_vs_tmpfs",
            "load_vs_tmpfs", "store_vs_backing_dir", "load_vs_backing_dir",
            "load_nvme_vs_backing_dir")) + " |")
    L += ["", "## Targets", ""]
    for v in results["verdicts"]:
        state = "not measured" if v["met"] is None else ("**met**" if v["met"] else "**NOT met**")
        value = "—" if v["value"] is None else f"{v['value']:.3f}"
        L.append(f"- {v['threads']} threads, {v['ratio'].replace('_vs_', ' ÷ ')} ≥ {v['goal']}: "
                 f"{value} — {state}")
    met = [v for v in results["verdicts"] if v["met"]]
    L += ["", f"{len(met)} of {len(results['verdicts'])} target checks met.", ""]
    ex = results.get("exists")
    if ex:
        cols = (*EXISTS_KINDS, "small_store_files_s")
        L += ["## os.path.exists (single thread, calls/s)", ""]
        L += [f"- `{k}`: {v}" for k, v in ex["kinds"].items()]
        L += ["- `small store`: llmd_write of the 4 KiB present blocks, files/s (for scale)", "",
              "| target | " + " | ".join(c.replace("_files_s", "").replace("_", " ")
                                        for c in cols) + " |",
              "|---|" + "---|" * len(cols)]
        for tname, rates in ex["targets"].items():
            L.append(f"| {tname} | " + " | ".join(fmt(rates[k]) for k in cols) + " |")
        for other in ("tmpfs", "passthrough_ll"):
            r = ex.get(f"ratio_vs_{other}")
            if r:
                L.append(f"| bluecache ÷ {other} | " + " | ".join(fmt(r[k]) for k in cols) + " |")
        L.append("")
    lat = results.get("request_latency")
    if lat:
        L += ["## Per-request cost (µs per call, single thread)", "",
              "| bluecached ping (zmq only) | statvfs tmpfs | statvfs passthrough_ll | "
              "statvfs bluecache mount |", "|---|---|---|---|",
              f"| {lat.get('bluecached_ping_us')} | {lat.get('statvfs_tmpfs_us')} | "
              f"{lat.get('statvfs_passthrough_ll_us', '—')} | {lat.get('statvfs_bluecache_us')} |",
              "", "statvfs is never cached by FUSE: on the mount each call is kernel → hostd "
              "(pyfuse3) → bluecached (zmq) and back; a 32 MiB file is 32 such 1 MiB requests "
              "in a row per thread (FUSE direct_io sends a synchronous read/write in 1 MiB "
              "pieces, one at a time), plus about 10 metadata requests for a store.", ""]
    L += ["## CPU seconds per GiB moved (mean over reps)", "",
          "| threads | phase | hostd | bluecached | passthrough_ll | bench (client threads) |",
          "|---|---|---|---|---|---|"]
    def per_gib(p, phase, target, proc):
        t = p["targets"].get(target)
        if not t:
            return None
        vals = [r[phase]["cpu_s"].get(proc) for r in t["reps"]]
        vals = [v for v in vals if v is not None]
        return round(statistics.mean(vals) / (p["bytes"] / GiB), 2) if vals else None

    for p in points:
        for phase in ("store", "load"):
            L.append(f"| {p['threads']} | {phase} | "
                     f"{fmt(per_gib(p, phase, 'bluecache', 'hostd'))} | "
                     f"{fmt(per_gib(p, phase, 'bluecache', 'bluecached'))} | "
                     f"{fmt(per_gib(p, phase, 'passthrough_ll', 'passthrough_ll'))} | "
                     f"{fmt(per_gib(p, phase, 'bluecache', 'bench'))} (bluecache), "
                     f"{fmt(per_gib(p, phase, 'tmpfs', 'bench'))} (tmpfs) |")
    L.append("")
    L += ["## Profile (py-spy, 8 threads through the mount)", ""]
    L += profile_md(results.get("profile"))
    cfg = results["config"]
    ptll = cfg["passthrough_ll"]
    L += ["## Setup", "",
          f"- bluecached: `{json.dumps(cfg['bluecached'])}` (other keys default: write-behind, "
          "durability fsync); hostd: `" + json.dumps(cfg["hostd"]) + "` (other keys default: "
          "direct_io, 1 MiB staging slots, read-ahead 4).",
          f"- passthrough_ll: {ptll.get('source', '')} "
          + ("built" if ptll.get("ok") else f"NOT built: {ptll.get('error')}")
          + f"; run as `{ptll.get('command', '')}` — defaults {ptll.get('defaults', '')}.",
          f"- dirs: tmpfs {cfg['dirs']['tmpfs']}, backing {cfg['dirs']['backing_dir']} "
          f"({cfg['dirs']['backing_fs']}), NVMe tier {cfg['dirs']['nvme']} "
          f"({cfg['dirs']['nvme_fs']}).",
          "- other busy processes at start: "
          + ("; ".join(results["other_processes_at_start"]) or "none") + ".",
          f"- warm-up before the points (untimed in the tables): {results.get('warm_up')}.", ""]
    if results.get("notes"):
        L += ["Notes from the run:", ""] + [f"- {n}" for n in results["notes"]] + [""]
    text = "\n".join(L)
    if old_analysis:
        text += "\n" + old_analysis
    path.write_text(text.rstrip() + "\n")


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 files of 8 MiB, threads 1 and 8")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--reps", type=int)
    ap.add_argument("--out", type=Path, help="output dir (default docs/benchmarks, or "
                                             "/tmp/bluecache-mount-bench-quick with --quick)")
    ap.add_argument("--profile-seconds", type=float)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-passthrough", action="store_true", help="skip building passthrough_ll")
    ap.add_argument("--hostd", action="append", default=[], metavar="KEY=VALUE",
                    help="a hostd setting other than the default (YAML value), e.g. "
                         "mount.read_ahead=0")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite mount.png and mount.md from the mount.json in the output dir")
    args = ap.parse_args()
    quick = args.quick
    args.threads = args.threads or ([1, 8] if quick else [1, 8, 64])
    args.reps = args.reps or (1 if quick else 3)
    size = 8 * MiB if quick else 32 * MiB
    min_files = 8 if quick else 32
    prof_s = args.profile_seconds or (3 if quick else 10)
    out_dir = args.out or (Path("/tmp/bluecache-mount-bench-quick") if quick
                           else ROOT / "docs" / "benchmarks")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        results = json.loads((out_dir / "mount.json").read_text())
        results["verdicts"] = verdicts(results)
        plot(results, out_dir / "mount.png")
        write_md(results, out_dir / "mount.md")
        print(f"rewrote {out_dir}/mount.png and mount.md from mount.json")
        return 0
    if os.geteuid() != 0:
        print("needs root (mounts, drop_caches, apt-get source)", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    started = time.perf_counter()
    notes: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="bcmb-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bcmb-", dir="/dev/shm"))
    build_dir = Path(tempfile.mkdtemp(prefix="bcmb-ptll-", dir="/tmp"))
    spy_dir = Path(tempfile.mkdtemp(prefix="bcmb-spy-", dir="/tmp"))
    bench = Bench(args, work, shm, notes)
    bc_settings = {"tiers.dram.size": "3GiB", "tiers.nvme.path": str(work / "bc" / "nvme"),
                   "tiers.nvme.size": "4GiB", "tiers.nvme.segment_size": "1GiB"}
    results: dict = {
        "benchmark": "mount", "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *sys.argv], "quick": quick,
        "machine": harness.machine_info(**versions()), "git": harness.git_revision(),
        "other_processes_at_start": other_busy_processes({os.getpid()}),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    try:
        for d in (bench.dirs["tmpfs"], bench.dirs["backing_dir"], bench.dirs["bluecache"]):
            d.mkdir(parents=True, exist_ok=True)
        ptll_info = {"skipped": True} if args.no_passthrough else build_passthrough_ll(build_dir)
        if ptll_info.get("ok"):
            src = shm / "ptsrc"
            ptll = PassthroughLL(ptll_info["binary"], src, bench.dirs["passthrough_ll"],
                                 work / "passthrough_ll.log")
            bench.ptll = ptll   # stopped in finally even if the start fails half-way
            try:
                ptll.start()
            except RuntimeError as e:
                ptll.stop()
                bench.ptll = None
                ptll_info.update(ok=False, error=f"built, but did not mount: {e}")
        if ptll_info.get("ok"):
            ptll_info["command"] = f"passthrough_ll -f -o source={src} <mnt>"
            ptll_info["defaults"] = ("cache=auto (kernel page cache kept until the next open, "
                                     "no direct_io), timeout=1.0 s (entry/attr), no writeback "
                                     "cache, multi-threaded (max_threads 10), no clone_fd, "
                                     "no xattr")
            ptll_info.pop("help", None)
        else:
            notes.append(f"passthrough_ll not measured: {ptll_info.get('error', 'skipped')}")
        hostd_settings = {k: yaml.safe_load(v) for k, _, v in
                          (h.partition("=") for h in args.hostd)}
        bench.bc = Bluecache(work / "bc", bench.dirs["bluecache"], bc_settings, hostd_settings)
        bench.bc.start()
        results["config"] = {
            "file_bytes": size, "files_per_point": f"max({min_files}, threads)",
            "threads": args.threads, "reps": args.reps, "read_piece": READ_PIECE,
            "bluecached": bc_settings, "hostd": {"request_timeout": "20s", **hostd_settings},
            "passthrough_ll": ptll_info,
            "dirs": {"tmpfs": str(bench.dirs["tmpfs"]),
                     "backing_dir": str(bench.dirs["backing_dir"]),
                     "backing_fs": fs_type(bench.dirs["backing_dir"]),
                     "nvme": bc_settings["tiers.nvme.path"],
                     "nvme_fs": fs_type(work), "mount": str(bench.dirs["bluecache"])},
        }
        base = os.urandom(size)
        print("warm-up", flush=True)
        results["warm_up"] = warm_up(bench, max(min_files, *args.threads), size, base)
        results["request_latency"] = request_latency(bench, 500 if quick else 5000)
        print(f"  {results['request_latency']}", flush=True)
        results["points"] = []
        for k, threads in enumerate(args.threads):
            files = max(min_files, threads)
            print(f"point: {threads} threads, {files} × {size // MiB} MiB", flush=True)
            results["points"].append(bench.point(threads, files, size, (k + 1) * 10_000, base))
        print("os.path.exists rates", flush=True)
        results["exists"] = exists_rates(bench, 2000 if quick else 20_000,
                                         200 if quick else 2000, 500_000)
        if not args.no_profile:
            print("profile", flush=True)
            results["profile"] = profile(bench, prof_s, 8, 32 if not quick else 8, size,
                                         900_000, base, spy_dir)
        results["verdicts"] = verdicts(results)
        results["bluecache_logs"] = {
            "bluecached_problems": bench.bc.daemon.unexpected_log_lines(),
            "hostd_problems": bench.bc.hostd.unexpected_log_lines()}
    finally:
        if bench.bc is not None:
            bench.bc.stop()
        if bench.ptll is not None:
            bench.ptll.stop()
        for mnt in (bench.dirs["bluecache"], bench.dirs["passthrough_ll"]):
            force_unmount(mnt)
        still = [str(m) for m in (bench.dirs["bluecache"], bench.dirs["passthrough_ll"])
                 if is_mounted(m)]
        for d in (work, shm, build_dir, spy_dir):
            if not still:
                shutil.rmtree(d, ignore_errors=True)
        if still:
            print(f"WARNING: still mounted: {still}; left {work} in place", file=sys.stderr)
    results["duration_s"] = round(time.perf_counter() - started, 1)
    end_digest = harness.git_revision()["daemon_sources_sha256"]
    if end_digest != results["git"]["daemon_sources_sha256"]:
        results["git"]["daemon_sources_sha256_at_end"] = end_digest
        notes.append("the daemons' sources changed during the run (sha256 at start "
                     f"{results['git']['daemon_sources_sha256'][:16]}…, at end "
                     f"{end_digest[:16]}…): "
                     "bluecached restarts after the change ran the new code")
    results["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    results["notes"] = notes
    (out_dir / "mount.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out_dir / "mount.png")
    write_md(results, out_dir / "mount.md")
    print(f"wrote {out_dir}/mount.json, mount.png, mount.md in {results['duration_s']:.0f} s")
    for v in results["verdicts"]:
        print(f"  {v['threads']:3d} threads {v['ratio']:26s} {v['value'] or 0:6.3f} "
              f"(goal {v['goal']}) {'met' if v['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
