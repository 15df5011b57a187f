"""Shared test helpers: an in-process store over real files, and byte patterns."""

import errno
import hashlib
import mmap
import os
import stat
from pathlib import Path

import trio

from bluecached.compose import assemble_store
from bluecached.dma import RegionTable
from bluecached.dma.loopback import LoopbackEngine
from bluecached.namespace import ROOT_INO, FsError
from bluecached.shm import SharedRegion
from bluecached.store import Store

MiB = 1 << 20


def pattern(seed: str, size: int) -> bytes:
    """Deterministic bytes that differ per seed and per position (so shifts show)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}:{counter}".encode(), digest_size=64).digest() * 256
        counter += 1
    return bytes(out[:size])


def run(fn, *args):
    return trio.run(fn, *args, strict_exception_groups=True)


class Harness:
    """A Store wired as the daemon wires it, minus sockets: ops are called directly."""

    def __init__(self, root: Path, dram: int = 64 * MiB, nvme: int = 256 * MiB,
                 segment: int = 64 * MiB, write_through: bool = False, marks=(0.9, 0.75),
                 nvme_marks=(0.95, 0.85), tmp_max_age: float = 3600, region_size: int = 64 * MiB):
        self.root = root
        self.kw = dict(dram=dram, nvme=nvme, segment=segment, write_through=write_through,
                       marks=marks, nvme_marks=nvme_marks, tmp_max_age=tmp_max_age)
        self.engine = LoopbackEngine()
        self.regions = RegionTable(self.engine)
        self.shm = SharedRegion(region_size)
        self.region = self.regions.add(self.engine.register(("memfd", self.shm.fd, region_size)))
        self.events: list[tuple[str, dict]] = []
        self.store = self._open()

    def _open(self, last_boot: int = 0) -> Store:
        kw = self.kw
        store = assemble_store(
            self.engine, dram_size=kw["dram"], dram_marks=kw["marks"],
            nvme_path=self.root / "nvme", nvme_size=kw["nvme"], segment_size=kw["segment"],
            nvme_marks=kw["nvme_marks"], o_direct="auto", durable=True,
            write_through=kw["write_through"], journal_max_bytes=1 << 30,
            tmp_max_age=kw["tmp_max_age"])
        store.publish = lambda event, **f: self.events.append((event, f))
        store.load(last_boot)
        return store

    def reopen(self, clean: bool = True, last_boot: int = 0) -> Store:
        """A daemon restart: clean (SIGTERM: flush + checkpoint) or not (SIGKILL).
        `last_boot`: the state directory's boot (bluecached/boots.py)."""
        old = self.store
        if clean:
            run(old.flush_all)
            old.checkpoint()
        if old.tiers.nvme:
            old.tiers.nvme.close()
            old.tiers.journal.close()
        self.store = self._open(last_boot)
        return self.store

    def serve(self, fn, *args):
        """Runs fn with the daemon's background tasks (write-behind, evictor) alongside."""
        async def with_workers():
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(self.store.tiers.writeback_worker)
                nursery.start_soon(self.store.tiers.evictor)
                result = await fn(*args)
                nursery.cancel_scope.cancel()
            return result
        return run(with_workers)

    # -- path helpers (what a client would do) ---------------------------------------------

    def _parent(self, path: str) -> tuple[int, bytes]:
        parts = [p.encode() for p in path.strip("/").split("/")]
        ino = ROOT_INO
        for part in parts[:-1]:
            try:
                ino = self.store.mkdir(ino, part, 0o755, 0, 0).ino
            except FsError as e:
                if e.errno != errno.EEXIST:
                    raise
                ino = self.store.lookup(ino, part).ino
        return ino, parts[-1]

    async def put(self, path: str, data: bytes, flags: int = os.O_WRONLY | os.O_TRUNC) -> None:
        parent, name = self._parent(path)
        handle = await self.store.create(parent, name, 0o644, 0, 0, flags | os.O_CREAT)
        await self.write(handle.fh, 0, data)
        self.store.release(handle.fh)

    async def write(self, fh: int, offset: int, data: bytes, step: int = MiB) -> None:
        for pos in range(0, len(data), step):
            piece = data[pos:pos + step]
            self.shm.view[:len(piece)] = piece
            await self.store.write(fh, offset + pos, len(piece), self.region, 0)

    async def read(self, fh: int, offset: int, length: int, step: int = MiB,
                   at: int = 0) -> bytes:
        """Read in `step` pieces through the region at offset `at`: concurrent readers each
        need a place of their own there (a read may wait after its copy into the region,
        e.g. a read to the end of an arriving object waits for the arrival to complete)."""
        out = bytearray()
        while len(out) < length:
            n = await self.store.read(fh, offset + len(out), min(step, length - len(out)),
                                      self.region, at)
            if n == 0:
                break
            out += self.shm.view[at:at + n]
        return bytes(out)

    async def get(self, path: str) -> bytes:
        node = self.store.ns.resolve(path)
        handle = await self.store.open(node.ino, os.O_RDONLY)
        try:
            return await self.read(handle.fh, 0, node.size)
        finally:
            self.store.release(handle.fh)

    async def settle(self) -> None:
        """Runs write-behind for everything dirty (what the workers do in the daemon)."""
        tiers = self.store.tiers
        for node in list(tiers.lru_dram.values()):
            node.obj.queued = False
            if node.obj.dirty and not node.obj.writers and node.parent is not None:
                async with node.obj.content_lock():
                    await tiers.writeback(node)

    def check_consistency(self) -> None:
        """Post-condition: the tiers' bookkeeping agrees with the objects and the pool."""
        store = self.store
        tiers = store.tiers
        chunks = 0
        dirty = 0
        logical = 0
        for node in store.ns.inodes.values():
            if node.is_dir:
                assert stat.S_ISDIR(node.mode)
                for name, (_, child) in node.children.items():
                    assert (node.ino, name) in store.ns.inodes[child].names()
                continue
            for parent, name in node.names():   # every name an entry, nlink counting them
                assert store.ns.inodes[parent].children[name][1] == node.ino
            assert node.nlink == len(node.names())
            if node.is_meta:   # symlinks and special files: no object, in no tier
                assert node.obj is None
                assert node.ino not in tiers.lru_dram and node.ino not in tiers.lru_nvme
                continue
            obj = node.obj
            logical += node.size
            if obj.chunks is not None:
                assert node.ino in tiers.lru_dram
                chunks += sum(c is not None for c in obj.chunks) + len(obj.deferred)
            else:
                assert node.ino not in tiers.lru_dram
            if obj.dirty:
                dirty += node.size
            assert (node.ino in tiers.lru_nvme) == obj.persisted
        assert tiers.dram.used_bytes == chunks * MiB
        assert tiers.dirty_bytes == dirty
        assert store.logical_bytes == logical

    def close(self) -> None:
        if self.store.tiers.nvme:
            self.store.tiers.nvme.close()
            self.store.tiers.journal.close()
        self.regions.remove(self.region.id)
        self.shm.close()


# -- a real bluecached process ---------------------------------------------------------------

import contextlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import yaml  # noqa: E402

from bluecached.supervisor import NotReady, Supervised, python_module  # noqa: E402
from bluecached.wire import protocol  # noqa: E402
from bluecached.wire.client import RegionChannel, SyncClient  # noqa: E402


def start_supervised(name: str, module: str, config: Path, notify: Path, log: Path,
                     env: dict | None = None) -> Supervised:
    """A daemon started as systemd starts it, its config file given."""
    return Supervised(name, python_module(module, "--config", str(config)), notify, log=log,
                      env=env).start()


def wait_ready(process: Supervised, log: Path, timeout: float) -> None:
    """Until it said READY=1; RuntimeError with its log if it did not."""
    try:
        process.wait_ready(timeout)
    except NotReady as e:
        raise RuntimeError(f"{e}:\n" + log.read_text()) from None


class DaemonProcess:
    """bluecached started the way systemd starts it: its own process, a config file, and a
    NOTIFY_SOCKET on which the test reads READY=1."""

    def __init__(self, root: Path, **settings):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state_dir = root / "state"
        cfg = {"state_dir": str(self.state_dir), "log_level": "info",
               "tiers": {"dram": {"size": "256MiB"},
                         "nvme": {"path": str(root / "nvme"), "size": "1GiB",
                                  "segment_size": "256MiB"}},
               "metrics": {"listen": ""}}
        for key, value in settings.items():   # dotted keys: "tiers.dram.size"
            node = cfg
            *parents, last = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        self.config = root / "bluecached.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.endpoints = protocol.state_dir_endpoints(str(self.state_dir))
        self.process: Supervised | None = None
        self.log = root / "bluecached.log"

    def start(self, timeout: float = 30, env: dict | None = None) -> "DaemonProcess":
        """Starts it and waits for READY=1 (a restart waits for the new process's)."""
        self.process = start_supervised("bluecached", "bluecached.daemon", self.config,
                                        self.root / "notify.sock", self.log, env)
        wait_ready(self.process, self.log, timeout)
        return self

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    @property
    def notify_messages(self) -> list[str]:
        return self.process.messages if self.process else []

    def drain_notify(self) -> list[str]:
        return self.process.drain()

    def client(self, timeout: float = 10) -> SyncClient:
        return SyncClient(self.endpoints["control"], timeout=timeout)

    def regions(self) -> RegionChannel:
        return RegionChannel(self.endpoints["regions"])

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Signals the daemon (if it runs) and waits (SIGKILL after `timeout`); returns its exit
        status."""
        return self.process.stop(sig, timeout) if self.process else 0

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        return self.log.read_text()

    def unexpected_log_lines(self, allowed=()) -> list[str]:
        """WARNING/ERROR lines not matching any of `allowed` substrings, and tracebacks."""
        bad = []
        for line in self.log_text().splitlines():
            if (" WARNING " in line or " ERROR " in line or "Traceback" in line) and \
                    not any(a in line for a in allowed):
                bad.append(line)
        return bad


class FileClient:
    """Blocking file operations over the protocol, as hostd performs them (region + ops)."""

    def __init__(self, daemon: DaemonProcess, region_size: int = 64 * MiB):
        self.client = daemon.client()
        self.channel = daemon.regions()
        self.shm = SharedRegion(region_size)
        self.region = self.channel.register(self.shm)

    def mkdirs(self, path: str) -> tuple[int, bytes]:
        parts = [p.encode() for p in path.strip("/").split("/")]
        ino = ROOT_INO
        for part in parts[:-1]:
            try:
                ino = self.client.call("mkdir", parent=ino, name=part, mode=0o755, uid=0,
                                       gid=0)["ino"]
            except OSError as e:
                if e.errno != errno.EEXIST:
                    raise
                ino = self.client.call("lookup", parent=ino, name=part)["ino"]
        return ino, parts[-1]

    def put(self, path: str, data: bytes, step: int = 8 * MiB, tmp_suffix: str | None = None):
        parent, name = self.mkdirs(path)
        target = name + tmp_suffix.encode() if tmp_suffix else name
        opened = self.client.call("create", parent=parent, name=target, mode=0o644, uid=0,
                                  gid=0, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for pos in range(0, len(data), step):
            piece = data[pos:pos + step]
            self.shm.view[:len(piece)] = piece
            self.client.call("write", fh=opened["fh"], offset=pos, length=len(piece),
                             region=self.region, region_offset=0)
        if tmp_suffix:
            self.client.call("rename", parent=parent, name=target, new_parent=parent,
                             new_name=name)
        self.client.call("release", fh=opened["fh"])

    def get(self, path: str, step: int = 8 * MiB) -> bytes:
        ino = ROOT_INO
        for part in path.strip("/").split("/"):
            ino = self.client.call("lookup", parent=ino, name=part.encode())["ino"]
        opened = self.client.call("open", ino=ino, flags=os.O_RDONLY)
        out = bytearray()
        try:
            while True:
                n = self.client.call("read", fh=opened["fh"], offset=len(out), length=step,
                                     region=self.region, region_offset=0)["length"]
                if not n:
                    return bytes(out)
                out += self.shm.view[:n]
        finally:
            self.client.call("release", fh=opened["fh"])

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        self.shm.close()


class HostdProcess:
    """bluecache-hostd mounting a temp dir, connected to a DaemonProcess."""

    def __init__(self, daemon: DaemonProcess, mountpoint: Path, **settings):
        self.daemon = daemon
        self.mountpoint = mountpoint
        self.root = daemon.root
        cfg = {"mountpoint": str(mountpoint), "state_dir": str(daemon.state_dir),
               "daemon": {"request_timeout": "20s"},
               "metrics": {"listen": ""}}   # tests side by side: no shared default port
        for key, value in settings.items():
            node = cfg
            *parents, last = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        self.config = self.root / "hostd.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = self.root / "hostd.log"
        self.process: Supervised | None = None

    def start(self, timeout: float = 30) -> "HostdProcess":
        self.process = start_supervised("hostd", "hostd.daemon", self.config,
                                        self.root / "hostd-notify.sock", self.log)
        wait_ready(self.process, self.log, timeout)
        return self

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        return self.process.stop(sig, timeout) if self.process else 0

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def unexpected_log_lines(self, allowed=()) -> list[str]:
        if not self.log.exists():
            return []
        return [line for line in self.log.read_text().splitlines()
                if (" WARNING " in line or " ERROR " in line or "Traceback" in line)
                and not any(a in line for a in allowed)]


def engine_settings(engine: str) -> dict:
    """Config settings (dotted keys) for bluecached and hostd to run `engine`. "doca" is the
    DOCA engine on the DOCA API simulator: this machine has no BlueField."""
    if engine == "loopback":
        return {"bluecached": {}, "hostd": {}}
    if engine == "doca":
        return {"bluecached": {"engine": "doca", "doca.library": "simulator",
                               "doca.pci_address": "03:00.0"},
                "hostd": {"doca.library": "simulator", "doca.pci_address": "b1:00.0"}}
    raise ValueError(engine)


def is_mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def force_unmount(path: Path) -> None:
    """Unmounts whatever is mounted at `path` and lifts hostd's guard of the bare directory
    (mode 000, immutable: see hostd.mount.guard_bare), so that the test's temp dir can go."""
    from hostd.mount import MountError, unguard_bare

    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False)
    with contextlib.suppress(OSError, MountError):
        unguard_bare(path)


_ports_given: set[int] = set()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (tests running side by side must not collide),
    and never one this process was given before: a test that asks twice (control and events)
    could otherwise get the same port back, since nothing holds the first one yet."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_given:
            _ports_given.add(port)
            return port


def wait_settled(daemon: DaemonProcess, timeout: float = 60) -> dict:
    """Waits until write-behind is done and eviction is quiet; returns the last stats."""
    client = daemon.client()
    try:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            stats = client.call("stats")
            key = (stats["dirty_bytes"], stats["tiers"].get("nvme", {}).get("bytes"),
                   stats["tiers"]["dram"]["bytes"])
            if stats["dirty_bytes"] == 0 and key == last:
                time.sleep(0.3)      # let the last events reach hostd
                return stats
            last = key
            time.sleep(0.2)
        raise TimeoutError(f"cache did not settle: {stats}")
    finally:
        client.close()


NOBODY = 65534   # user nobody, group nogroup on Debian
# A command run as user nobody with no supplementary groups: the second, unprivileged user.
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def let_others_reach(path) -> None:
    """pytest's temp directories are 0700: let user nobody walk down to `path`."""
    d = os.path.dirname(str(path))
    while d not in ("/", ""):
        mode = os.stat(d).st_mode
        if not mode & 0o001:
            os.chmod(d, (mode & 0o7777) | 0o001)
        d = os.path.dirname(d)


def wait_serving(root, timeout: float = 30) -> None:
    """Until the mount answers again (hostd reconnects to a restarted bluecached by itself)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.listdir(root)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def smaps_fields(inode: int, span: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of this process's one mapping `span` bytes long of the
    file with that `inode`."""
    import re
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)", line)
            if head:
                inside = int(head[3]) == inode and int(head[2], 16) - int(head[1], 16) == span
            elif inside and line.split(":")[0].isidentifier() and line.rstrip().endswith("kB"):
                name, value = line.split(":")
                fields[name] = int(value.split()[0])
    return fields


def pmd_mapped_kib(fd: int, length: int) -> int:
    """How much of a shmem file (memfd) a fresh mapping maps with 2 MiB entries once each
    2 MiB is read: the kernel does so only for pages it allocated as 2 MiB ones."""
    import mmap
    with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ) as whole:
        whole.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, length, 2 << 20):
            whole[offset]
        return smaps_fields(os.fstat(fd).st_ino, length).get("ShmemPmdMapped", 0)


class ScratchBtrfs:
    """A real btrfs (data checksums on, as by default) on a loop device over a sparse file: the
    filesystem under the NVMe tier where its hits are reflink clones read by the kernel
    (bluecached/tiers/nvme_clone.py). Root, losetup and mkfs.btrfs (btrfs-progs) needed."""

    def __init__(self, root: Path, size: int = 512 << 20):
        root.mkdir(parents=True, exist_ok=True)
        self.image = root / "btrfs.img"
        self.path = root / "fs"
        self.path.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(size)
        self.device = subprocess.run(
            ["losetup", "--find", "--show", "--direct-io=on", str(self.image)],
            check=True, capture_output=True, text=True).stdout.strip()
        try:
            subprocess.run(["mkfs.btrfs", "-q", "-f", self.device], check=True,
                           capture_output=True)
            subprocess.run(["mount", self.device, str(self.path)], check=True,
                           capture_output=True)
        except BaseException:
            subprocess.run(["losetup", "-d", self.device], check=False)
            raise

    def rot(self, marker: bytes, at: int) -> None:
        """Flips one byte `at` bytes past where `marker` (a page of file data, unique) sits on
        the device, beneath btrfs: rot on the disk."""
        os.sync()
        with open(self.image, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            where = m.find(marker)
            assert where >= 0 and m.find(marker, where + 1) < 0, "marker not found once"
            m[where + at] ^= 0xFF
            m.flush()
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")   # btrfs must read the disk again

    def close(self) -> None:
        # lazy: a daemon the test left running still holds it (the device goes with it)
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", self.device], check=False, capture_output=True)
