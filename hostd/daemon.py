"""bluecache-hostd: mounts the cache and serves it.

Startup: config -> connect to bluecached (handshake, staging registered) -> clear a stale mount
-> guard the bare mountpoint (mount.guard_bare) -> mount -> READY=1. SIGTERM/SIGINT: STOPPING=1,
unmount, exit (the bare mountpoint stays guarded). If bluecached restarts the mount stays;
requests wait for it (see link.py).
"""

import argparse
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from .shim import load_shim  # first: the fuse shim must be loaded before pyfuse3

SHIM, SHIM_PROBLEM = load_shim()

import pyfuse3  # noqa: E402
import trio  # noqa: E402
import zmq  # noqa: E402

from bluecached import __version__, huge_pages, logs, metrics  # noqa: E402
from bluecached.notify import Notifier  # noqa: E402
from bluecached.paths import describe  # noqa: E402
from bluecached.startup import StartupError, run_service  # noqa: E402
from bluecached.wire import curve, protocol  # noqa: E402
from bluecached.wire.client import AsyncClient  # noqa: E402
from bluecached.wire.local_transport import LocalClient  # noqa: E402
from bluecached.wire.zmqpump import SocketPump  # noqa: E402
from fusefs import Operations, Timeouts  # noqa: E402
from fusefs.inplace import InPlaceWrites  # noqa: E402
from fusefs.ioctl import IoctlDispatch  # noqa: E402

from . import config  # noqa: E402
from . import metrics as hostd_metrics  # noqa: E402
from .fuse_features import FuseFeatures  # noqa: E402
from .fuse_log import answer_to_a_gone_connection  # noqa: E402
from .ioctl import ZeroCopyTransfers  # noqa: E402
from .kept_backings import KeptBackings  # noqa: E402
from .link import DaemonLink, DocaSetupError  # noqa: E402
from .mount import (  # noqa: E402
    FSNAME,
    MountError,
    clear_stale,
    fuse_device_problem,
    guard_bare,
    make_mountpoint,
    mounts_at,
    unmount,
)

log = logging.getLogger("hostd")
UNMOUNT_DRAIN_S = 10
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters


def _endpoints(cfg) -> tuple[str, str, str | None, dict | None]:
    """control, events, the loopback region socket (embedded only), CURVE keys (tcp only).
    Embedded mode's control endpoint is the local SEQPACKET socket, not zmq."""
    local = protocol.state_dir_endpoints(str(cfg.state_dir))
    link = cfg.daemon
    control = local["local"] if link.control == "ipc" else link.control
    events = local["events"] if link.events == "ipc" else link.events
    keys = None
    if control.startswith("tcp://"):
        try:
            keys = curve.client_keys(Path(link.curve_dir), link.curve_name)
        except curve.CurveError as e:
            raise StartupError(str(e)) from None
    regions = local["regions"] if link.control == "ipc" else None
    return control, events, regions, keys


async def _follow_events(events_endpoint: str, keys, ops: Operations, link: DaemonLink) -> None:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if keys:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            keys["server_public"], keys["public"], keys["secret"])
    sock.setsockopt(zmq.SUBSCRIBE, protocol.EVENT_REMOVED)
    if link.kept is not None:
        sock.setsockopt(zmq.SUBSCRIBE, protocol.EVENT_LEFT_DRAM)
    sock.connect(events_endpoint)

    def on_event(frames):
        try:
            topic, fields = protocol.decode_event(frames)
            if topic == protocol.EVENT_LEFT_DRAM:
                link.kept.drop(fields["ino"])
                return
            if link.kept is not None:
                link.kept.drop(fields["ino"])
            log.debug("event: removed %s (%s)", fields.get("name"), fields.get("reason"))
            if fields.get("parent") is not None:
                ops.forget_name(fields["parent"], fields["name"], fields["ino"])
        except (protocol.ProtocolError, KeyError, TypeError) as e:
            log.warning("ignored a malformed event: %s", e)

    try:
        await SocketPump(sock).run(on_event)
    finally:
        sock.close()


def _no_answer(control: str, waited: float) -> str:
    """Why bluecached did not answer the first handshake, as far as the socket tells."""
    if control.startswith("tcp://"):
        return f"bluecached does not answer at {control} (waited {waited:g}s): is it running?"
    path = Path(control)
    state_dir = path.parent
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(2)
    try:
        probe.connect(str(path))
    except FileNotFoundError:
        there = f"no {path.name} there" if state_dir.is_dir() else "it does not exist"
        return (f"bluecached is not running with state directory {state_dir} ({there}; "
                f"waited {waited:g}s)")
    except ConnectionRefusedError:
        return (f"bluecached is not running with state directory {state_dir} (waited "
                f"{waited:g}s; {path.name} is left from one that stopped: connection refused)")
    except PermissionError:
        return (f"permission denied: {path} (hostd runs as uid {os.geteuid()}; bluecached's "
                "sockets are for its own user: run hostd as root)")
    except OSError as e:
        return f"cannot connect to bluecached at {path}: {e.strerror}"
    finally:
        probe.close()
    return (f"bluecached at {path} accepts connections but does not answer (waited "
            f"{waited:g}s): is it hung, or still loading its index?")


async def run(cfg, path: Path | None, notifier, assignments: list[str] | None = None) -> None:
    control, events, regions, keys = _endpoints(cfg)
    mountpoint = Path(cfg.mountpoint)
    problem = fuse_device_problem()
    if problem:
        raise StartupError(f"cannot mount {mountpoint}: {problem}")
    name = f"hostd@{os.uname().nodename}"
    if cfg.daemon.control == "ipc":   # same machine: the SEQPACKET fast path
        client = LocalClient(control, client_name=name)
    else:
        client = AsyncClient(control, keys, client_name=name)
    link = DaemonLink(client, regions, cfg.mount.staging_slots, cfg.daemon.request_timeout,
                      cfg.doca, ack_staged=cfg.mount.write_ack == "staged",
                      read_ahead=cfg.mount.read_ahead,
                      kept=KeptBackings(cfg.mount.kept_opens, cfg.mount.kept_idle)
                      if cfg.mount.passthrough and cfg.mount.kept_opens else None,
                      large_reads=cfg.mount.max_pages * 4096,
                      huge_staging=cfg.mount.huge_pages and huge_pages.allow_advised())
    features = FuseFeatures(SHIM, cfg.mount) if SHIM is not None else None
    ops = Operations(link, Timeouts(cfg.mount.entry_timeout, cfg.mount.attr_timeout,
                                    cfg.mount.negative_timeout),
                     passthrough=features.passthrough if features else None)
    link.on_restart = ops.forget_everything
    counts = hostd_metrics.FuseCounts()
    counts.instrument(ops)
    collector = hostd_metrics.HostdCollector(counts, link)
    readiness = hostd_metrics.Readiness(mountpoint, link, f"fuse.{FSNAME}")
    if features is not None and features.passthrough is not None:
        link.wants_backing = features.passthrough.negotiated
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            if cfg.metrics.listen:
                try:
                    await nursery.start(metrics.serve, cfg.metrics.listen, metrics.routes(
                        metrics.registry(collector), readiness))
                except OSError as e:
                    raise StartupError(f"metrics endpoint {cfg.metrics.listen}: cannot listen: "
                                       f"{e.strerror or e}") from None
            try:
                await link.connect()
            except trio.TooSlowError:
                raise StartupError(await trio.to_thread.run_sync(
                    _no_answer, control, cfg.daemon.request_timeout)) from None
            except DocaSetupError as e:
                raise StartupError(str(e)) from None
            nursery.start_soon(link.watch)
            nursery.start_soon(link.forward_releases)
            await nursery.start(link.send_writes)
            await nursery.start(link.confirm_opens_answered_here)
            if features is not None and features.passthrough is not None:
                nursery.start_soon(features.passthrough.sweep_every, 0.5)
            nursery.start_soon(_follow_events, events, keys, ops, link)
            try:
                await trio.to_thread.run_sync(_prepare_mountpoint, mountpoint)
            except MountError as e:
                raise StartupError(str(e)) from None
            except OSError as e:
                raise StartupError(f"mountpoint {mountpoint}: {describe(e, mountpoint)}") \
                    from None
            options = set(pyfuse3.default_options) | {f"fsname={FSNAME}", f"subtype={FSNAME}"}
            if cfg.mount.allow_other:
                options.add("allow_other")
            if SHIM is not None and cfg.mount.reader_thread:
                SHIM.lib.bc_use_reader_thread()
            try:
                pyfuse3.init(ops, str(mountpoint), options)
            except RuntimeError as e:
                raise StartupError(f"cannot mount {mountpoint}: {e}") from None
            if SHIM is not None:
                collector.transfers = ZeroCopyTransfers(link, cfg.zero_copy.kept_regions,
                                                        cfg.zero_copy.region_idle)
                nursery.start_soon(collector.transfers.regions.run)
                ioctls = IoctlDispatch(SHIM, counts.transfers(collector.transfers),
                                       ops.forget_attributes)
                await nursery.start(ioctls.run)
                log.info("zero-copy %s", ioctls.state())
            else:
                log.warning("zero-copy ioctl unavailable (%s); the POSIX path works", SHIM_PROBLEM)
            if SHIM is not None and cfg.mount.reader_thread:
                if SHIM.lib.bc_reader_state() == 1:
                    log.info("requests are read from /dev/fuse in a thread of their own")
                else:
                    log.warning("the fuse shim's reader thread did not start: the event loop "
                                "reads requests itself")
            in_place = None
            if SHIM is not None and cfg.mount.receive_in_place:
                in_place = InPlaceWrites(SHIM, counts.slot_writer(link))
                problem = in_place.start()
                if problem is None:
                    collector.in_place = in_place
                    log.info("writes are received in place (into staging slots)")
                else:
                    log.warning("writes are copied: %s", problem)
            fuse_done = trio.Event()
            stopping = False

            async def serve_fuse():
                try:
                    await pyfuse3.main()
                    if not stopping:
                        # The kernel ended the session by itself: it aborted the connection
                        # because a request went unanswered for mount.kernel_request_timeout
                        # (hostd was stopped or hung). The mount answers ENOTCONN from now on:
                        # exit with an error, so that systemd restarts hostd, which clears
                        # the dead mount and mounts again.
                        log.error("the kernel aborted the FUSE connection (a request went "
                                  "unanswered for mount.kernel_request_timeout): %s answers "
                                  "ENOTCONN until hostd is restarted", mountpoint)
                        raise ConnectionAbortedError(errno.ECONNABORTED, "FUSE session ended")
                except* ConnectionAbortedError:
                    # A busy mount is detached lazily at stop; the kernel may then end the
                    # connection under the loop's read (ECONNABORTED): the session is over,
                    # which is what the stop asked for. At any other time it is an error.
                    if not stopping:
                        raise
                    log.info("the kernel ended the FUSE connection")
                finally:
                    fuse_done.set()

            nursery.start_soon(serve_fuse)
            negotiated = f" ({await features.report()})" if features else ""
            notifier.notify(f"READY=1\nSTATUS=serving {mountpoint}{negotiated}")
            readiness.state = "serving"
            log.info("serving %s from bluecached at %s", mountpoint, control)
            try:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        cfg = _reload(cfg, path, assignments or [])
                        continue
                    log.info("%s: unmounting %s", signal.Signals(signum).name, mountpoint)
                    notifier.notify("STOPPING=1")
                    stopping = link.stopping = True
                    readiness.state = "stopping"
                    break
                # Unmount while still serving, so the kernel's last RELEASE and FORGET requests
                # get answers; the FUSE loop ends when the kernel closes the session.
                await trio.to_thread.run_sync(unmount, mountpoint)
                with trio.move_on_after(UNMOUNT_DRAIN_S):
                    await fuse_done.wait()
            finally:
                pyfuse3.terminate()
                pyfuse3.close(unmount=not fuse_done.is_set())
                if in_place is not None:
                    log.info("writes received in place: %(in_place)d, copied: %(copied)d",
                             in_place.counts())
                    in_place.stop()
                nursery.cancel_scope.cancel()
    link.close()
    if link.read_ahead is not None:
        log.info("reads answered from read-ahead: %d, read-aheads thrown away: %d",
                 link.read_ahead.served, link.read_ahead.wasted)
    if features is not None:
        log.info("%s%s", features.summary(), "" if link.kept is None else
                 f", of them answered by hostd alone: {link.kept.answered}"
                 f" (kept files), {link.kept.answered_prepared} (prepared at the lookup)")
    log.info("stopped; hostd copied %d payload bytes", link.bytes_copied)


def _keep_request_buffers() -> None:
    """pyfuse3 allocates a fresh 1 MiB buffer per request. With glibc's defaults that is an
    mmap and munmap each time, and every page faulted in again (~100k faults per GiB stored).
    Raising the mmap and trim thresholds keeps such buffers on the heap for reuse."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):   # not glibc: nothing to tune
        pass


def _prepare_mountpoint(mountpoint: Path) -> None:
    # A mountpoint given as a symlink is mounted (and listed in mountinfo) at its target.
    mounted_at = mountpoint
    if not mounts_at(mountpoint) and os.path.islink(mountpoint):
        mounted_at = Path(os.path.realpath(mountpoint))
    clear_stale(mounted_at)   # may wait seconds for a hung mount to answer: not on the loop
    make_mountpoint(mountpoint)   # with its parents, as mkdir -p; a file there is refused
    guard_bare(mountpoint)    # nothing written under the mount while it is not there


def _reload(cfg, path: Path | None, assignments: list[str]):
    """SIGHUP: the file and --set again; applies what the table says can change live (the log
    level). Returns the configuration now running."""
    try:
        new = config.load_config(path, assignments=assignments)
    except config.ConfigError as e:
        log.error("reload refused: %s", e)
        return cfg
    _, restart = config.apply_reload(cfg, new)
    for key in restart:
        log.warning("reload: %s changed but needs a restart to take effect", key)
    return cfg if restart else new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bluecache-hostd",
                                     description="Mount the bluecache KV cache.")
    parser.add_argument("--config", type=Path,
                        help=f"config file (default {config.DEFAULT_PATH} if it exists)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a dotted key over the config file, e.g. mount.read_ahead=8 "
                             "(VALUE as written in the file); repeatable")
    parser.add_argument("--version", action="version", version=f"bluecache-hostd {__version__}")
    args = parser.parse_args(argv)
    path = args.config or (config.DEFAULT_PATH if config.DEFAULT_PATH.exists() else None)
    try:
        cfg = config.load_config(path, assignments=args.set)
    except config.ConfigError as e:
        print(f"bluecache-hostd: {e}", file=sys.stderr)
        return 2
    _keep_request_buffers()
    logs.setup(cfg.log_level)
    logging.getLogger("pyfuse3").addFilter(answer_to_a_gone_connection)
    return run_service(run, cfg, path, Notifier(), args.set, log=log)

if __name__ == "__main__":
    sys.exit(main())
