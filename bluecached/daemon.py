"""bluecached: process entry, service startup order, signals, sd_notify.

Startup: config -> lock the state (and NVMe) directory (statelock.py) -> index rebuild ->
sockets -> services started one by one (each reports ready through nursery.start) -> READY=1.
SIGTERM/SIGINT: STOPPING=1, stop serving, write every dirty object behind, checkpoint the
index. SIGHUP reloads what can change live.
"""

import argparse
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import trio
import zmq

from . import __version__, boots, config, huge_pages, logs, metrics, statelock
from .compose import build_store
from .dma import EngineUnavailable, RegionTable, make_engine
from .dma.loopback import serve_regions
from .kv_events import KvEvents
from .notify import Notifier
from .paths import PathProblem, describe
from .server import ControlServer
from .startup import StartupError, run_service
from .tiers import nvme_clone
from .tiers.dram import map_ahead, unmap_behind
from .tiers.journal import JournalError
from .verify import Verifier
from .wire import curve, local_transport, protocol
from .wire.zmqpump import SocketPump

log = logging.getLogger("bluecached")
WRITEBACK_WORKERS = 2


class Daemon:
    def __init__(self, cfg, config_path: Path | None, assignments: list[str] | None = None):
        self.cfg = cfg
        self.config_path = config_path
        self.assignments = assignments or []   # --set: a reload applies them over the file again
        # Before anything under the state and NVMe directories is touched (sockets, journal):
        # a second daemon on them must not start. Held for the process's lifetime.
        nvme_dir = Path(cfg.tiers.nvme.path) if cfg.tiers.nvme.size else None
        _check_socket_paths(Path(cfg.state_dir))
        try:
            self.locks = statelock.lock_directories(Path(cfg.state_dir), nvme_dir)
        except (statelock.DirectoryInUse, PathProblem) as e:
            raise StartupError(str(e)) from None
        except OSError as e:
            raise StartupError(f"cannot lock {e.filename or cfg.state_dir}: {e.strerror}") \
                from None
        self.notifier = Notifier()
        # Before any object is written or loaded: pages allocated small stay small.
        if cfg.tiers.dram.huge_pages:
            huge_pages.allow_within_size()
        try:
            self.engine = make_engine(cfg.engine, cfg.doca)
        except (ValueError, EngineUnavailable) as e:
            raise StartupError(f"engine {cfg.engine}: {e}") from None
        self.regions = RegionTable(self.engine)
        self.store = build_store(cfg, self.engine)
        self.verifier = Verifier(self.store)
        self.server: ControlServer | None = None
        self.events: SocketPump | None = None
        self.kv_events: KvEvents | None = None   # kv_events.enabled: docs/operations.md
        self._auth = None
        self.serving = False   # READY=1 said and no stop begun: what /readyz answers
        self.stopping = False

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> dict:
        tiers = self.store.tiers
        dram = {"bytes": tiers.dram.used_bytes, "capacity_bytes": tiers.dram.capacity,
                "objects": len(tiers.lru_dram), **tiers.stats.dram.as_dict()}
        out = {"tiers": {"dram": dram}}
        if tiers.nvme is not None:
            out["tiers"]["nvme"] = {"bytes": tiers.nvme.used_bytes,
                                    "capacity_bytes": tiers.nvme.capacity,
                                    "objects": len(tiers.lru_nvme),
                                    **tiers.stats.nvme.as_dict()}
        server = self.server
        out.update(
            files=sum(1 for n in self.store.ns.inodes.values() if not n.is_dir),
            dirty_bytes=tiers.dirty_bytes,
            checksum_failures=tiers.stats.checksum_failures,
            writeback_failures=tiers.stats.writeback_failures,
            tmp_collected=tiers.stats.tmp_collected,
            requests=server.requests if server else 0,
            bad_messages=server.bad_messages if server else 0,
            open_handles=len(self.store.handles),
            regions=len(self.regions))
        if self.kv_events is not None:
            out["kv_events"] = dict(self.kv_events.stats, sequence=self.kv_events.seq)
        remote = self.store.remote
        if remote is not None:
            out["tiers"]["remote"] = remote.tier_stats()
            out["remote"] = {"up": int(remote.reachable), "queue_length": remote.queue_length(),
                             **remote.stats.as_dict()}
        return out

    def status(self) -> dict:
        cfg = self.cfg
        tiers = self.store.tiers
        return {"version": __version__, "pid": os.getpid(), "engine": self.engine.name,
                "engine_detail": self.engine.describe(),
                "state_dir": str(cfg.state_dir), "control": self.endpoints["control"],
                "events": self.endpoints["events"],
                "write_policy": cfg.write_policy, "durability": cfg.durability,
                "o_direct": bool(tiers.nvme and tiers.nvme.o_direct),
                "nvme_path": str(cfg.tiers.nvme.path) if tiers.nvme else None,
                "sessions": len(self.server.sessions) if self.server else 0,
                "verify": self.verifier.progress(), "summary": self.summary(),
                "remote": self.store.remote.status() if self.store.remote else None}

    async def readiness(self) -> str | None:
        """/readyz: None while the store is open and requests are served."""
        if self.serving:
            return None
        return "stopping" if self.stopping else "starting (loading the index)"

    def summary(self) -> str:
        tiers = self.store.tiers
        gib = 1 << 30
        text = (f"{sum(1 for n in self.store.ns.inodes.values() if not n.is_dir)} files; "
                f"dram {tiers.dram.used_bytes / gib:.1f}/{tiers.dram.capacity / gib:.1f} GiB")
        if tiers.nvme is not None:
            text += f"; nvme {tiers.nvme.used_bytes / gib:.1f}/{tiers.nvme.capacity / gib:.1f} GiB"
        remote = self.store.remote
        if remote is not None:
            text += (f"; remote {'up' if remote.reachable else 'DOWN'}, "
                     f"{remote.queue_length()} queued")
        return text + f"; engine {self.engine.name}"

    # -- sockets ---------------------------------------------------------------------------

    def _bind(self, sock: zmq.Socket, listen: str, name: str) -> str:
        cfg = self.cfg
        if listen == "ipc":
            endpoint = protocol.state_dir_endpoints(cfg.state_dir)[name]
            old = os.umask(0o177)  # socket file mode 0600: local root (hostd) only
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as e:
                raise _cannot_listen(endpoint, zmq.strerror(e.errno)) from None
            finally:
                os.umask(old)
            return endpoint
        if self._auth is None:
            try:
                self._auth = curve.secure_server(self.ctx, sock, Path(cfg.control.curve_dir))
            except curve.CurveError as e:
                raise StartupError(str(e)) from None
        else:
            self._configure_curve(sock)
        try:
            sock.bind(listen)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot listen on {listen}: {e}") from None
        return listen

    def _configure_curve(self, sock: zmq.Socket) -> None:
        public, secret = zmq.auth.load_certificate(
            str(Path(self.cfg.control.curve_dir) / "server.key_secret"))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def open_sockets(self) -> None:
        cfg = self.cfg
        Path(cfg.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # zmq drops a peer that sends more than this; the decoder's own limit (with a log line
        # and an error reply) is the one clients normally meet.
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.control.max_message_bytes)
        self.publisher = self.ctx.socket(zmq.PUB)
        self.publisher.setsockopt(zmq.LINGER, 0)
        self.endpoints = {"control": self._bind(self.router, cfg.control.listen, "control"),
                          "events": self._bind(self.publisher, cfg.control.events, "events")}
        if cfg.kv_events.enabled:
            self.kv_events = KvEvents(cfg.kv_events)
            try:
                self.kv_events.open(self.ctx)
            except zmq.ZMQError as e:
                raise StartupError(f"kv_events: cannot listen on {e.endpoint}: "
                                   f"{zmq.strerror(e.errno)}") from None

    def close_sockets(self) -> None:
        self.router.close()
        self.publisher.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    def publish(self, event: str, **fields) -> None:
        if self.events is not None:
            self.events.send(protocol.encode_event(event.encode(), fields))

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        state_dir = Path(self.cfg.state_dir)
        try:
            await trio.to_thread.run_sync(lambda: self.store.load(boots.last_boot(state_dir)))
        except JournalError as e:
            raise StartupError(str(e)) from None
        try:   # before any client is served, so before any inode number of this run
            await trio.to_thread.run_sync(boots.record_boot, state_dir, self.store.boot)
        except OSError as e:
            raise StartupError(f"cannot record the boot in {state_dir}: {describe(e)}") \
                from None
        self.store.publish = self.publish
        self.open_sockets()
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async with trio.open_nursery() as services:
                    await self._start_services(services)
                    self.notifier.notify(f"READY=1\nSTATUS={self.summary()}")
                    self.serving = True
                    log.info("serving on %s (events %s); %s", self.endpoints["control"],
                             self.endpoints["events"], self.summary())
                    async for signum in sigs:
                        if signum == signal.SIGHUP:
                            self.reload()
                            continue
                        log.info("%s: stopping", signal.Signals(signum).name)
                        self.serving, self.stopping = False, True
                        self.notifier.notify("STOPPING=1")
                        services.cancel_scope.cancel()
                        break
            await self.shutdown()
        finally:
            self.close_sockets()

    async def _start_services(self, services: trio.Nursery) -> None:
        cfg = self.cfg
        await services.start(self.engine.serve)
        self.server = ControlServer(self.store, self.regions, self.status, self.stats,
                                    self.verifier, cfg.control.max_message_bytes,
                                    cfg.control.session_timeout)
        await services.start(self.server.run, self.router)
        local = protocol.state_dir_endpoints(cfg.state_dir)
        try:
            await services.start(local_transport.serve, local["local"], self.server)
        except OSError as e:
            raise _cannot_listen(local["local"], e.strerror) from None
        self.events = SocketPump(self.publisher)
        services.start_soon(self.events.run)
        if self.kv_events is not None:   # the held blocks first, then every change
            self.kv_events.announce_held(self.store.ns)
            await services.start(self.kv_events.run)
            self.store.kv_events = self.kv_events
        if self.engine.name == "loopback":   # the doca engine's regions come as DOCA exports
            try:
                await services.start(serve_regions, local["regions"], self.regions)
            except OSError as e:
                raise _cannot_listen(local["regions"], e.strerror) from None
        if cfg.metrics.listen:
            try:
                await services.start(metrics.serve, cfg.metrics.listen, metrics.routes(
                    metrics.registry(metrics.StatsCollector(self.stats)), self.readiness))
            except OSError as e:
                raise StartupError(f"metrics endpoint {cfg.metrics.listen}: cannot listen: "
                                   f"{e.strerror or e}") from None
        tiers = self.store.tiers
        for _ in range(WRITEBACK_WORKERS if tiers.nvme else 0):
            services.start_soon(tiers.writeback_worker)
        services.start_soon(tiers.evictor)
        if tiers.nvme is not None and cfg.tiers.nvme.hit_path != "promote":
            tiers.promotions.configure(_hit_path(cfg.tiers.nvme.hit_path, tiers.nvme.path))
            tiers.read_lanes.depth = cfg.tiers.nvme.read_depth
            await services.start(tiers.promotions.run)
        services.start_soon(unmap_behind, tiers.dram)
        if cfg.tiers.dram.prefault:
            services.start_soon(map_ahead, tiers.dram, cfg.tiers.dram.prefault)
        if self.store.remote is not None:
            await services.start(self.store.remote.run)
            self.store.remote.admit_persisted()
        services.start_soon(self.store.maintain)
        services.start_soon(self.store.watch_kernel_writes)
        services.start_soon(self.store.check_mapped_writes)
        services.start_soon(self._report_status)
        tiers.kick_writeback_all()

    async def _report_status(self) -> None:
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        watchdog = usec and int(os.environ.get("WATCHDOG_PID", os.getpid())) == os.getpid()
        interval = min(5.0, usec / 2e6) if watchdog else 5.0
        while True:
            self.notifier.status(self.summary(), watchdog=bool(watchdog))
            await trio.sleep(interval)

    def reload(self) -> None:
        try:
            new = config.load_config(self.config_path, assignments=self.assignments)
        except config.ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            return
        tiers = self.store.tiers
        live, restart = config.apply_reload(self.cfg, new, tiers)
        for key in restart:
            log.warning("reload: %s changed but needs a restart to take effect", key)
        self.cfg = new if not restart else self.cfg
        log.info("reloaded %s: %s", self.config_path or "defaults",
                 ", ".join(f"{k}={v}" for k, v in live.items()) or "nothing changed live")
        tiers._pressure.set()

    async def shutdown(self) -> None:
        with trio.CancelScope(shield=True):
            await self.store.flush_all()
            self.store.checkpoint()
            tiers = self.store.tiers
            if tiers.nvme is not None:
                tiers.nvme.close()
            if tiers.journal is not None:
                tiers.journal.close()
            if self.store.remote is not None:
                await self.store.remote.close()
            log.info("stopped cleanly; %s", self.summary())


SUN_PATH_MAX = 107   # sizeof(sockaddr_un.sun_path) less the terminating NUL


def _check_socket_paths(state_dir: Path) -> None:
    """The daemon's sockets live in state_dir: a path too long for a unix socket would only
    fail once the index is loaded, with zmq's or the kernel's wording."""
    for endpoint in protocol.state_dir_endpoints(str(state_dir)).values():
        path = endpoint.removeprefix("ipc://")
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise StartupError(f"state directory {state_dir}: the path is too long for the "
                               f"daemon's sockets ({path} is {len(os.fsencode(path))} bytes, "
                               f"at most {SUN_PATH_MAX})")


def _cannot_listen(endpoint: str, reason: str) -> StartupError:
    """A socket in the state directory that cannot be bound: says so if something that is not
    a socket is in its way (zmq calls that "Address already in use")."""
    path = endpoint.removeprefix("ipc://")
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a file"
        reason = f"{kind} of that name is in the way"
    return StartupError(f"cannot listen on {path}: {reason}")


def _hit_path(configured: str, nvme_path: Path) -> str:
    """tiers.nvme.hit_path as it will run: auto is clone where the NVMe directory's filesystem
    checks its data itself (tiers/nvme_clone.py), else direct; clone where it does not is a
    start-up error, naming why."""
    if configured not in ("auto", "clone"):
        return configured
    why = nvme_clone.unchecked_reason(nvme_path)
    if why is None:
        log.info("NVMe hits: reflink clones read by the kernel (%s checks its data)", nvme_path)
        return "clone"
    if configured == "clone":
        raise StartupError(f"tiers.nvme.hit_path clone: {nvme_path}: {why}; use direct, or "
                           f"put tiers.nvme.path on btrfs with data checksums")
    log.info("NVMe hits: read and checked by bluecached (hit_path direct: %s)", why)
    return "direct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bluecached", description="bluecache cache daemon")
    parser.add_argument("--config", type=Path, help=f"config file (default "
                        f"{config.DEFAULT_PATH} if it exists, else built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a dotted key over the config file, e.g. tiers.dram.size=1GiB "
                             "(VALUE as written in the file); repeatable")
    parser.add_argument("--version", action="version", version=f"bluecached {__version__}")
    args = parser.parse_args(argv)
    default = config.DEFAULT_PATH if config.DEFAULT_PATH.exists() else None
    path = args.config if args.config else default
    try:
        cfg = config.load_config(path, assignments=args.set)
    except config.ConfigError as e:
        print(f"bluecached: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_level)
    try:
        daemon = Daemon(cfg, path, args.set)
    except StartupError as e:
        log.error("cannot start: %s", e)
        return 1
    return run_service(daemon.run, log=log)


if __name__ == "__main__":
    sys.exit(main())
