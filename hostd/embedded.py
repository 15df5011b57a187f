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
from bluecached.config import DEFAULT_PATH, ConfigError, load_config
from bluecached.config.schema import OVERRIDE, SET_OPTION
from bluecached.paths import PathProblem, describe, make_directory, not_a_directory
from bluecached.supervisor import NotReady, Supervised, python_module, set_options

from .config import DEFAULT_PATH as HOSTD_DEFAULT_PATH
from .config import load_config as load_hostd_config
from .mount import mounts_at


def _notify_systemd(message: str) -> None:
    path = os.environ.get("NOTIFY_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect("\0" + path[1:] if path.startswith("@") else path)
            s.send(message.encode())


def _daemon(name: str, module: str, config: Path | None, assignments: list[str],
            settings: dict, state: Path) -> Supervised:
    """The daemon's config is `config` (None: its built-in defaults; /dev/null keeps the
    packaged /etc/bluecache file out), the operator's --set `assignments` over it, then
    `settings` (dotted keys: what `up` decides) over those. Its own session (a terminal's
    Ctrl-C reaches only `up`, which stops the daemons in order), but it dies with `up`; its
    log goes to `up`'s stderr."""
    sets = [option for a in assignments for option in ("--set", a)]
    return Supervised(name, python_module(module, "--config", str(config or os.devnull),
                                          *sets, *set_options(settings)),
                      state / f"up-{name}.notify", new_session=True, die_with_parent=True)


# The option of `up` that sets each overridden key, for its error messages.
OPTIONS = {"state_dir": "--state-dir", "metrics.listen": "--metrics",
           "tiers.dram.size": "--dram-size", "tiers.nvme.size": "--nvme-size"}
HOSTD_OPTIONS = {"state_dir": "--state-dir", "mountpoint": "--mount",
                 "metrics.listen": "--hostd-metrics"}
DAEMONS = ("bluecached", "hostd")


class UpError(Exception):
    """A problem with `up`'s options or config files: one line, exit status 2."""


def config_file(given: str | None, default: Path) -> Path | None:
    """The config file a daemon started by `up` reads: the one given (\"\" for none), else
    the packaged one where it exists."""
    if given is None:
        return default if default.exists() else None
    return Path(given) if given else None


def split_assignments(assignments: list[str]) -> dict[str, list[str]]:
    """`--set bluecached.KEY=VALUE` and `--set hostd.KEY=VALUE`: each daemon's own --set
    options (KEY=VALUE)."""
    out: dict[str, list[str]] = {name: [] for name in DAEMONS}
    for assignment in assignments:
        key, equals, value = assignment.partition("=")
        daemon, dot, rest = key.strip().partition(".")
        if not (equals and dot and rest.strip() and daemon in out):
            raise UpError(f"--set {assignment}: expected bluecached.KEY=VALUE or "
                          f"hostd.KEY=VALUE (the daemon whose key it is, then the key as in "
                          f"its file), e.g. bluecached.tiers.dram.size=8GiB")
        out[daemon].append(f"{rest}={value}")
    return out


def _load(name: str, load, path: Path | None, overrides: dict, assignments: list[str],
          options: dict):
    try:
        return load(path, overrides, assignments)
    except ConfigError as e:
        if e.source == OVERRIDE and e.key:
            raise UpError(f"{options.get(e.key, e.key)}: {e.problem}") from None
        if e.source == SET_OPTION:
            where = f"--set {name}.{e.key}" if e.key else f"--set: {name}"
            raise UpError(f"{where}: {e.problem}") from None
        raise UpError(f"{name}'s config {e}") from None


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


def up(mount: str | None, state_dir: str | None, dram_size: str | None,
       nvme_size: str | None, allow_other: bool = True, metrics: str | None = None, *,
       config: str | None = None, hostd_config: str | None = None,
       assignments: list[str] = (), hostd_metrics: str | None = None) -> int:
    """Defaults (None) come from the daemons' config files (`config`, `hostd_config`: the
    packaged /etc/bluecache ones where they exist; "" for none), then their tables. Over the
    files: `assignments` ("bluecached.KEY=VALUE", "hostd.KEY=VALUE"), then `up`'s options."""
    bluecached_path = config_file(config, DEFAULT_PATH)
    hostd_path = config_file(hostd_config, HOSTD_DEFAULT_PATH)
    overrides = {}
    if state_dir:
        overrides["state_dir"] = str(Path(state_dir).resolve())
    if metrics is not None:
        overrides["metrics.listen"] = metrics
    if dram_size:
        overrides["tiers.dram.size"] = dram_size
    if nvme_size:
        overrides["tiers.nvme.size"] = nvme_size
    try:
        sets = split_assignments(list(assignments))
        cfg = _load("bluecached", load_config, bluecached_path, overrides, sets["bluecached"],
                    OPTIONS)
        state = Path(cfg.state_dir).resolve()
        # embedded mode: hostd reaches this bluecached through the sockets in its state_dir
        hostd_overrides = {"state_dir": str(state), "daemon.control": "ipc",
                           "daemon.events": "ipc"}
        if mount:
            hostd_overrides["mountpoint"] = str(Path(mount).absolute())
        if not allow_other:
            hostd_overrides["mount.allow_other"] = False
        if hostd_metrics is not None:
            hostd_overrides["metrics.listen"] = hostd_metrics
        hcfg = _load("hostd", load_hostd_config, hostd_path, hostd_overrides, sets["hostd"],
                     HOSTD_OPTIONS)
        if cfg.metrics.listen and cfg.metrics.listen == hcfg.metrics.listen:
            raise UpError(f"bluecached and hostd would both serve metrics at "
                          f"{cfg.metrics.listen}: give each its own (--metrics, "
                          f"--hostd-metrics)")
    except UpError as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        return 2
    mount = str(hcfg.mountpoint)
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
        "metrics.listen": cfg.metrics.listen or ""}
    hostd_settings = {"mountpoint": str(Path(mount).resolve()), "state_dir": str(state),
                      "daemon.control": "ipc", "daemon.events": "ipc",
                      "mount.allow_other": hcfg.mount.allow_other,
                      "metrics.listen": hcfg.metrics.listen or ""}
    print(f"bluecache config: bluecached {bluecached_path or 'built-in defaults'}, hostd "
          f"{hostd_path or 'built-in defaults'}"
          + (f"; --set {' '.join(assignments)}" if assignments else ""), flush=True)
    children: list[Supervised] = []
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        daemon = _daemon("bluecached", "bluecached.daemon", bluecached_path,
                         sets["bluecached"], bluecached_settings, state)
        children.append(daemon)
        daemon.start().wait_ready(120)
        hostd = _daemon("hostd", "hostd.daemon", hostd_path, sets["hostd"], hostd_settings,
                        state)
        children.append(hostd)
        hostd.start().wait_ready(60)
        gib = 1 << 30
        print(f"bluecache ready: {Path(mount).resolve()} (dram {cfg.tiers.dram.size / gib:g} GiB, "
              f"nvme {cfg.tiers.nvme.size / gib:g} GiB at {cfg.tiers.nvme.path}); "
              f"watch with: bluecachectl --state-dir {state} stats; Ctrl-C stops", flush=True)
        served = [f"{name} http://{listen}/metrics" for name, listen in
                  (("bluecached", cfg.metrics.listen), ("hostd", hcfg.metrics.listen)) if listen]
        if served:
            print(f"bluecache metrics: {', '.join(served)} (probes: /healthz, /readyz)",
                  flush=True)
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
