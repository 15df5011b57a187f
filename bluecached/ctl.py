"""bluecachectl: the operator's command line for bluecached."""

import argparse
import errno
import json
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

from . import __version__
from .config import BLUECACHED, DEFAULT_PATH
from .wire import curve, protocol
from .wire.client import RemoteError, SyncClient

# The daemon's defaults, from its table: what `up` and the other commands assume unless told.
DEFAULT_STATE_DIR = BLUECACHED.default("state_dir")
DEFAULT_CURVE_DIR = BLUECACHED.default("control.curve_dir")
DEFAULT_METRICS = BLUECACHED.default("metrics.listen")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _client(args) -> SyncClient:
    if args.endpoint:
        keys = None
        if args.endpoint.startswith("tcp://"):
            keys = curve.client_keys(Path(args.curve_dir), args.curve_name)
        _check_listening(args.endpoint, args.timeout)
        return SyncClient(args.endpoint, keys, timeout=args.timeout)
    endpoint = protocol.state_dir_endpoints(args.state_dir)["control"]
    _check_local_socket(endpoint, Path(args.state_dir))
    _check_listening(endpoint, args.timeout)
    return SyncClient(endpoint, timeout=args.timeout)


# How long the probe of an endpoint waits for a connection (at most --timeout).
PROBE_TIMEOUT = 2.0


def _check_local_socket(endpoint: str, state_dir: Path) -> None:
    """zmq connects to an ipc:// path in the background and would only time out: say at once
    when the socket is not there, or not ours to use."""
    sock = Path(endpoint.removeprefix("ipc://"))
    try:
        sock.lstat()
    except PermissionError:
        raise RemoteError(errno.EACCES, f"permission denied: {state_dir} is not readable by "
                                        f"this user (run bluecachectl as root)") from None
    except FileNotFoundError:
        raise RemoteError(errno.ECONNREFUSED, f"bluecached is not running at {endpoint} "
                                              f"(no {sock.name} in {state_dir})") from None
    if not os.access(sock, os.W_OK):
        raise RemoteError(errno.EACCES, f"permission denied: {sock} belongs to "
                                        f"{sock.owner()} (run bluecachectl as that user)")


def _check_listening(endpoint: str, timeout: float) -> None:
    """A connection of our own to the endpoint, closed at once: a socket left by a daemon
    that died, or a port nobody listens on, is a clear line now rather than a reply timeout
    later (zmq would wait for the daemon to come)."""
    if endpoint.startswith("ipc://"):
        family, address = socket.AF_UNIX, endpoint.removeprefix("ipc://")
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        family, address = None, (host.strip("[]"), int(port))
    else:
        return   # another zmq transport: zmq's own errors and timeout
    wait = min(PROBE_TIMEOUT, timeout)
    try:
        if family is None:
            probe = socket.create_connection(address, timeout=wait)
        else:
            probe = socket.socket(family, socket.SOCK_STREAM)
            probe.settimeout(wait)
            probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        raise RemoteError(errno.ECONNREFUSED, f"bluecached is not running at {endpoint} "
                                              "(connection refused)") from None
    except TimeoutError:
        raise RemoteError(errno.ETIMEDOUT, f"bluecached is not running at {endpoint} (no "
                                           f"connection within {wait:g}s: is it running, and "
                                           "is the port open to this host?)") from None
    except PermissionError:
        raise RemoteError(errno.EACCES, f"permission denied: {endpoint}") from None
    except OSError as e:
        raise RemoteError(e.errno or errno.EIO, f"cannot reach bluecached at {endpoint}: "
                                                f"{e.strerror or e}") from None
    probe.close()


def cmd_status(client, args) -> int:
    status = client.call("status")
    if args.json:
        print(json.dumps(status))
        return 0
    print(f"bluecached {status['version']} (pid {status['pid']}): {status['summary']}")
    print(f"  {'engine':13} {status['engine']}: {status['engine_detail']}")
    for key in ("control", "events", "state_dir", "nvme_path", "o_direct",
                "write_policy", "durability", "sessions"):
        print(f"  {key:13} {status[key]}")
    remote = status.get("remote")
    if remote:
        state = "reachable" if remote["reachable"] else "UNREACHABLE"
        print(f"  {'remote':13} {state}: {remote['endpoint']} bucket {remote['bucket']} "
              f"prefix {remote['prefix'] or '(none)'}, admission {remote['admission']}")
        print(f"  {'':13} queue {remote['queue']}/{remote['queue_max']}, "
              f"{remote['dropped']} dropped")
        if remote["last_error"]:
            print(f"  {'':13} last error {remote['last_error_age_s']}s ago: "
                  f"{remote['last_error']}")
    return 0


def cmd_stats(client, args) -> int:
    stats = client.call("stats")
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"{'tier':6} {'bytes':>12} {'capacity':>12} {'objects':>9} {'hits':>9} "
          f"{'misses':>9} {'evictions':>9}")
    for name, t in stats["tiers"].items():
        print(f"{name:6} {_size(t['bytes']):>12} {_size(t['capacity_bytes']):>12} "
              f"{t['objects']:>9} {t['hits']:>9} {t['misses']:>9} {t['evictions']:>9}")
    for key in ("files", "dirty_bytes", "checksum_failures", "writeback_failures",
                "tmp_collected", "open_handles", "regions", "requests", "bad_messages"):
        value = stats[key]
        print(f"{key:19} {_size(value) if key.endswith('bytes') else value}")
    return 0


def cmd_ls(client, args) -> int:
    for e in client.call("ls", path=args.path)["entries"]:
        name = e["name"].decode(errors="replace")
        kind = "d" if stat.S_ISDIR(e["mode"]) else "-"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["atime_ns"] / 1e9))
        print(f"{kind}{stat.filemode(e['mode'])[1:]} {e['size']:>12} {when} {e['tier']:9} {name}")
    return 0


def cmd_du(client, args) -> int:
    u = client.call("du", path=args.path)
    if args.json:
        print(json.dumps(u))
        return 0
    print(f"{_size(u['bytes'])} in {u['files']} files, {u['dirs']} directories "
          f"(dram {_size(u['dram_bytes'])}, nvme {_size(u['nvme_bytes'])}, "
          f"{u['dirty']} not yet on nvme)  {args.path}")
    return 0


def cmd_evict(client, args) -> int:
    if not args.all and not args.path:
        print("bluecachectl evict: give a PATH or --all", file=sys.stderr)
        return 2
    r = client.call("evict", all=True) if args.all else client.call("evict", path=args.path)
    print(f"removed {r['removed']} files" +
          (f"; {r['skipped_open']} open files kept" if r["skipped_open"] else ""))
    return 0


def cmd_verify(client, args) -> int:
    progress = client.call("verify", start=True)
    tty = sys.stderr.isatty()
    while progress["running"]:
        done, total = progress["done"], max(progress["total"], 1)
        bar = "#" * (30 * done // total)
        line = (f"\rverifying [{bar:<30}] {done}/{progress['total']} objects, "
                f"{_size(progress['bytes'])}, {progress['failed']} failed")
        print(line if tty else line.strip(), end="" if tty else "\n", file=sys.stderr, flush=True)
        time.sleep(0.2 if tty else 2)
        progress = client.call("verify")
    if tty:
        print(file=sys.stderr)
    print(f"verified {progress['done']} objects ({_size(progress['bytes'])}): "
          f"{progress['failed']} failed checksum and were removed")
    return 1 if progress["failed"] else 0


def cmd_up(args) -> int:
    """`up` runs hostd, which the DPU package does not ship: bluecached reaches it only where
    the host package is installed, and says so in one line where it is not."""
    try:
        from hostd.embedded import up
    except ImportError as e:
        if not (e.name or "").startswith("hostd"):
            raise
        print("bluecachectl up needs the host package (bluecache-host): it runs bluecached and "
              "hostd on one machine, and hostd is not installed here", file=sys.stderr)
        return 2
    return up(args.mount, args.state_dir, args.dram_size, args.nvme_size,
              not args.no_allow_other, args.metrics, config=args.config,
              hostd_config=args.hostd_config, assignments=args.set,
              hostd_metrics=args.hostd_metrics)


def cmd_keygen(args) -> int:
    curve_dir = Path(args.curve_dir)
    public, secret = curve.generate(curve_dir, args.name)
    print(f"wrote {public} and {secret}")
    if args.name == "server":
        (curve_dir / "clients").mkdir(exist_ok=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bluecachectl", description="Operate bluecached.")
    p.add_argument("--version", action="version", version=f"bluecachectl {__version__}")
    # No argparse default: `up` takes state_dir from bluecached's config file when not given.
    p.add_argument("--state-dir", default=None,
                   help=f"the daemon's state directory, where its sockets are (with `up`: "
                        f"where the cache keeps its data) (default {DEFAULT_STATE_DIR}; "
                        f"`up`: its config file's state_dir)")
    p.add_argument("--endpoint", help="talk to a daemon at this endpoint instead "
                                      "(tcp://HOST:PORT uses CURVE keys from --curve-dir)")
    p.add_argument("--curve-dir", default=DEFAULT_CURVE_DIR)
    p.add_argument("--curve-name", default="client", help="this client's key pair name")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="what is running and how full it is")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("stats", help="per-tier bytes, objects, hits, misses, evictions")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = sub.add_parser("ls", help="list a directory of the cache with each file's tier")
    s.add_argument("path", nargs="?", default="/")
    s = sub.add_parser("du", help="bytes and files below a path, per tier")
    s.add_argument("path", nargs="?", default="/")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("evict", help="remove a file or a directory's files from the cache")
    s.add_argument("path", nargs="?")
    s.add_argument("--all", action="store_true", help="everything that is not open")
    sub.add_parser("verify", help="re-check every checksum on NVMe (removes bad objects)")
    s = sub.add_parser("up", help="embedded mode: run bluecached and hostd here, mounted, in "
                                  "the foreground (Ctrl-C stops both)")
    s.add_argument("--mount", help="mountpoint (default: hostd's config's mountpoint, "
                                   "/mnt/kv-cache)")
    s.add_argument("--dram-size", help="DRAM tier size, e.g. 4GiB (default: the config's "
                                       f"tiers.dram.size, {BLUECACHED.default('tiers.dram.size')})")
    s.add_argument("--nvme-size", help="NVMe tier size, e.g. 64GiB; 0 disables (default: the "
                                       "config's tiers.nvme.size, "
                                       f"{BLUECACHED.default('tiers.nvme.size')})")
    s.add_argument("--no-allow-other", action="store_true",
                   help="only the mounting user may use the mount")
    s.add_argument("--metrics", metavar="HOST:PORT",
                   help=f"bluecached's Prometheus endpoint and probes (default: its config's "
                        f'metrics.listen, {DEFAULT_METRICS}; "" disables it)')
    s.add_argument("--hostd-metrics", metavar="HOST:PORT",
                   help="hostd's Prometheus endpoint and probes (default: its config's "
                        'metrics.listen, 127.0.0.1:9465; "" disables it)')
    s.add_argument("--config", metavar="FILE",
                   help=f"bluecached's config file, as its unit reads (default {DEFAULT_PATH} "
                        f'where it exists; "" for none)')
    s.add_argument("--hostd-config", metavar="FILE",
                   help="hostd's config file (default /etc/bluecache/hostd.yaml where it "
                        'exists; "" for none)')
    s.add_argument("--set", action="append", default=[], metavar="DAEMON.KEY=VALUE",
                   help="a key over that daemon's config file, as in the file: "
                        "bluecached.tiers.dram.size=8GiB, hostd.mount.read_ahead=8 "
                        "(repeatable; the options above win over it)")
    s = sub.add_parser("keygen", help="create a CURVE key pair for the tcp:// link")
    s.add_argument("--name", default="server", help="'server' on the DPU, a host name on hosts")
    # `bluecachectl up --state-dir DIR` reads naturally (the README and issue spell it so):
    # the directory options are accepted after the command too, and win there.
    for command in sub.choices.values():
        command.add_argument("--state-dir", default=argparse.SUPPRESS,
                             help="as the option before the command")
        command.add_argument("--curve-dir", default=argparse.SUPPRESS,
                             help="as the option before the command")
    return p


COMMANDS = {"status": cmd_status, "stats": cmd_stats, "ls": cmd_ls, "du": cmd_du,
            "evict": cmd_evict, "verify": cmd_verify}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command != "up":
        args.state_dir = args.state_dir or DEFAULT_STATE_DIR
    try:
        if args.command == "keygen":
            return cmd_keygen(args)
        if args.command == "up":
            return cmd_up(args)
        # Like any Unix tool: `bluecachectl stats | head` ends quietly. (Not for `up`, which
        # must outlive its reader to stop its daemons cleanly.)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        client = _client(args)
        try:
            return COMMANDS[args.command](client, args)
        except RemoteError as e:
            if getattr(args, "path", None):   # ls, du, evict: the daemon's answer is about it
                raise RemoteError(e.errno, f"{args.path}: {e.strerror}") from None
            raise
        finally:
            client.close()
    except (RemoteError, curve.CurveError) as e:
        print(f"bluecachectl {args.command}: {getattr(e, 'strerror', None) or e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
