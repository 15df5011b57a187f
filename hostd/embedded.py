"""`bluecachectl up`: embedded mode in the foreground — bluecached and hostd on this machine,
the cache mounted and ready for a connector.

Each daemon is started as its own process (as systemd would) with a config written into the
state dir, and reports READY=1 on a notify socket this supervisor listens on. SIGINT/SIGTERM
stop hostd first (unmount), then bluecached (write-behind and index checkpoint). If the
supervisor itself dies (SIGKILL included), the kernel sends both children SIGTERM.
"""

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from bluecached import statelock
from bluecached.config import ConfigError, load_config, parse_size
from bluecached.paths import PathProblem, describe, make_directory, not_a_directory

from .mount import mounts_at

DEFAULT_MOUNT = "/mnt/kv-cache"
DEFAULT_STATE = "/var/lib/bluecache"


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int):
    """A preexec_fn: the child gets SIGTERM when this supervisor dies, even by SIGKILL, so no
    daemon is left running unsupervised. SIGTERM, not SIGKILL: bluecached persists its cache
    and hostd unmounts, as on Ctrl-C. The kernel sends it when the thread that forked the child
    exits, so children are started from the main thread only (it lives as long as `up`)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("daemons must be started from the main thread")
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before the fork

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:   # the supervisor died before the prctl: nobody to signal
            os._exit(1)

    return preexec


class Child:
    def __init__(self, name: str, argv: list[str], notify_path: Path, log_path: Path | None):
        self.name = name
        self.notify_path = notify_path
        with contextlib.suppress(FileNotFoundError):
            notify_path.unlink()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(notify_path))
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONUNBUFFERED="1")
        # Its own session (a terminal's Ctrl-C reaches only this supervisor, which stops the
        # children in order), but it dies with the supervisor: see _die_with_parent.
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent(os.getpid()))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} "
                                   "before it was ready (its log is above)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} was not ready within {timeout:g}s")
            self.notify.settimeout(min(left, 0.5))
            try:
                if b"READY=1" in self.notify.recv(4096):
                    return
            except TimeoutError:
                pass

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"bluecachectl up: {self.name} did not stop in {timeout:g}s; killing it",
                      file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
        return self.proc.returncode


def _notify_systemd(message: str) -> None:
    path = os.environ.get("NOTIFY_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect("\0" + path[1:] if path.startswith("@") else path)
            s.send(message.encode())


DEFAULT_METRICS = "127.0.0.1:9464"

# The option of `up` that sets each overridden key, for its error messages.
OPTIONS = {"state_dir": "--state-dir", "metrics.listen": "--metrics",
           "tiers.dram.size": "--dram-size", "tiers.nvme.size": "--nvme-size"}


def _prepare(mount: str, state: Path, cfg) -> None:
    """Checks what `up` can check before it starts anything, so that a mountpoint or state
    directory in the wrong shape, or one in use, is one line (PathProblem) and nothing of a
    running `up` is overwritten: its state directory holds the daemons' configs."""
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


def up(mount: str, state_dir: str, dram_size: str | None, nvme_size: str | None,
       allow_other: bool = True, metrics: str = DEFAULT_METRICS) -> int:
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
        bluecached_yaml = state / "bluecached.yaml"
        bluecached_yaml.write_text(yaml.safe_dump({
            "state_dir": str(state), "tiers": {
                "dram": {"size": cfg.tiers.dram.size},
                "nvme": {"path": str(cfg.tiers.nvme.path), "size": cfg.tiers.nvme.size,
                         "segment_size": min(cfg.tiers.nvme.segment_size,
                                             max(cfg.tiers.nvme.size, 1 << 20))}},
            "metrics": {"listen": cfg.metrics.listen}}))
        hostd_yaml = state / "hostd.yaml"
        hostd_yaml.write_text(yaml.safe_dump({
            "mountpoint": str(Path(mount).resolve()), "state_dir": str(state),
            "mount": {"allow_other": allow_other}}))
    except PathProblem as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"bluecachectl up: cannot write the daemons' configs: {describe(e)}",
              file=sys.stderr)
        return 1
    python = sys.executable
    children: list[Child] = []
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        daemon = Child("bluecached", [python, "-m", "bluecached.daemon", "--config",
                                      str(bluecached_yaml)], state / "up-bluecached.notify", None)
        children.append(daemon)
        daemon.wait_ready(120)
        hostd = Child("hostd", [python, "-m", "hostd.daemon", "--config", str(hostd_yaml)],
                      state / "up-hostd.notify", None)
        children.append(hostd)
        hostd.wait_ready(60)
        gib = 1 << 30
        print(f"bluecache ready: {Path(mount).resolve()} (dram {cfg.tiers.dram.size / gib:g} GiB, "
              f"nvme {cfg.tiers.nvme.size / gib:g} GiB at {cfg.tiers.nvme.path}); "
              f"watch with: bluecachectl --state-dir {state} stats; Ctrl-C stops", flush=True)
        _notify_systemd("READY=1")
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} exited unexpectedly with status "
                                       f"{child.proc.returncode}")
            time.sleep(0.2)
        _notify_systemd("STOPPING=1")
    except RuntimeError as e:
        print(f"bluecachectl up: {e}", file=sys.stderr)
        status = 1
    finally:
        for child in reversed(children):
            code = child.stop()
            if code not in (0, None) and not status:
                print(f"bluecachectl up: {child.name} stopped with status {code}",
                      file=sys.stderr)
                status = 1
    if not status:
        print("bluecache stopped: unmounted, cache persisted", flush=True)
    return status
