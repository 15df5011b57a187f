"""`bluecachectl up`: embedded mode in the foreground — bluecached and hostd on this machine,
the cache mounted and ready for a connector.

Each daemon is started as its own process (as systemd would) with its settings given as
--set options, and reports READY=1 on a notify socket this supervisor listens on. SIGINT/SIGTERM
stop hostd first (unmount), then bluecached (write-behind and index checkpoint). If the
supervisor itself dies (SIGKILL included), the kernel sends both children SIGTERM.
"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

from bluecached import statelock
from bluecached.config import BLUECACHED, ConfigError, load_config, parse_size
from bluecached.paths import PathProblem, describe, make_directory, not_a_directory
from bluecached.supervisor import NotReady, Supervised, python_module, set_options

from .config import HOSTD
from .mount import mounts_at


def _notify_systemd(message: str) -> None:
    path = os.environ.get("NOTIFY_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect("\0" + path[1:] if path.startswith("@") else path)
            s.send(message.encode())


def _daemon(name: str, module: str, settings: dict, state: Path) -> Supervised:
    """`settings` (dotted keys) are the daemon's whole config: --config /dev/null keeps the
    packaged /etc/bluecache files out of it. Its own session (a terminal's Ctrl-C reaches only
    `up`, which stops the daemons in order), but it dies with `up`; its log goes to `up`'s
    stderr."""
    return Supervised(name, python_module(module, "--config", os.devnull,
                                          *set_options(settings)),
                      state / f"up-{name}.notify", new_session=True, die_with_parent=True)


# The option of `up` that sets each overridden key, for its error messages.
OPTIONS = {"state_dir": "--state-dir", "metrics.listen": "--metrics",
           "tiers.dram.size": "--dram-size", "tiers.nvme.size": "--nvme-size"}


def _prepare(mount: str, state: Path, cfg) -> None:
    """Checks what `up` can check before it starts anything, so that a mountpoint or state
    directory in the wrong shape, or one in use, is one line (PathProblem), and a second `up`
    on the state directory of a running one stops before it starts anything."""
    if not mounts_at(Path(mount).absolute()):   # a mount there is hostd's to judge
        problem = not_a_directory(Path(mount), "mountpoint")
        if problem:
            raise PathProblem(problem)
    make_directory(state, "state directory")
    nvme = Path(cfg.tiers.nvme.path) if cfg.tiers.nvme.size else None
    try:
        locks = statelock.lock_directories(state, nvme)
    except statelock.DirectoryInUse as e:
        raise PathProblem(str(e)) from None
    for lock in locks:     # bluecached takes them; this was only a look
        lock.release()


def up(mount: str | None, state_dir: str, dram_size: str | None, nvme_size: str | None,
       allow_other: bool = True, metrics: str | None = None) -> int:
    """Defaults (None) are the daemons' own, from their tables."""
    mount = mount or str(HOSTD.default("mountpoint"))
    if metrics is None:
        metrics = BLUECACHED.default("metrics.listen")
    state = Path(state_dir).resolve()
    overrides = {"state_dir": str(state), "metrics.listen": metrics}
    if dram_size:
        overrides["tiers.dram.size"] = dram_size
    if nvme_size:
        overrides["tiers.nvme.size"] = nvme_size
    try:
        cfg = load_config(None, overrides)
        for size in (dram_size, nvme_size):
            if size:
                parse_size(size)
    except ConfigError as e:
        where = OPTIONS.get(e.key, e.key) if e.key else e.source
        print(f"bluecachectl up: {where}: {e.problem}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        return 2
    try:
        _prepare(mount, state, cfg)
    except PathProblem as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"bluecachectl up: {state}: {describe(e)}", file=sys.stderr)
        return 1
    nvme = cfg.tiers.nvme
    bluecached_settings = {
        "state_dir": str(state), "tiers.dram.size": cfg.tiers.dram.size,
        "tiers.nvme.path": str(nvme.path), "tiers.nvme.size": nvme.size,
        "tiers.nvme.segment_size": min(nvme.segment_size, max(nvme.size, 1 << 20)),
        "metrics.listen": cfg.metrics.listen}
    hostd_settings = {"mountpoint": str(Path(mount).resolve()), "state_dir": str(state),
                      "mount.allow_other": allow_other}
    children: list[Supervised] = []
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        daemon = _daemon("bluecached", "bluecached.daemon", bluecached_settings, state)
        children.append(daemon)
        daemon.start().wait_ready(120)
        hostd = _daemon("hostd", "hostd.daemon", hostd_settings, state)
        children.append(hostd)
        hostd.start().wait_ready(60)
        gib = 1 << 30
        print(f"bluecache ready: {Path(mount).resolve()} (dram {cfg.tiers.dram.size / gib:g} GiB, "
              f"nvme {cfg.tiers.nvme.size / gib:g} GiB at {cfg.tiers.nvme.path}); "
              f"watch with: bluecachectl --state-dir {state} stats; Ctrl-C stops", flush=True)
        _notify_systemd("READY=1")
        while not stopping:
            for child in children:
                if not child.running():
                    raise RuntimeError(f"{child.name} exited unexpectedly with status "
                                       f"{child.proc.returncode}")
            time.sleep(0.2)
        _notify_systemd("STOPPING=1")
    except NotReady as e:
        print(f"bluecachectl up: {e} (its log is above)", file=sys.stderr)
        status = 1
    except RuntimeError as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        status = 1
    finally:
        for child in reversed(children):
            code = child.stop(timeout=120)
            if child.killed:
                print(f"bluecachectl up: {child.name} did not stop in 120s; killed it",
                      file=sys.stderr)
            if code not in (0, None) and not status:
                print(f"bluecachectl up: {child.name} stopped with status {code}",
                      file=sys.stderr)
                status = 1
    if not status:
        print("bluecache stopped: unmounted, cache persisted", flush=True)
    return status
