"""A daemon process run as systemd runs a Type=notify service: its own process, a NOTIFY_SOCKET
on which it says READY=1, and a stop that is a signal, then SIGKILL after a timeout.

One implementation for every place that starts bluecached or hostd: `bluecachectl up`
(hostd/embedded.py), the tests (tests/support.py) and the benches (bench/harness.py).
Standard library only.
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


class NotReady(RuntimeError):
    """The process exited before it said READY=1, or did not say it in time."""


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs `module` with this interpreter (and so this checkout)."""
    return [sys.executable, "-m", module, *args]


def set_options(settings: dict) -> list[str]:
    """`--set KEY=VALUE` options for a daemon: dotted keys, or nested dicts of them. Values as
    JSON, which the daemons read as YAML: quoted where a bare word would read otherwise."""
    options = []
    for key, value in settings.items():
        if isinstance(value, dict):
            options += set_options({f"{key}.{k}": v for k, v in value.items()})
        else:
            text = json.dumps(str(value) if isinstance(value, Path) else value)
            options += ["--set", f"{key}={text}"]
    return options


def _die_with_parent(parent: int):
    """A preexec_fn: the child gets SIGTERM when its supervisor dies, even by SIGKILL, so no
    daemon is left running unsupervised. SIGTERM, not SIGKILL: bluecached persists its cache
    and hostd unmounts, as on Ctrl-C. The kernel sends it when the thread that forked the child
    exits, so such children are started from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("daemons must be started from the main thread")
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before the fork

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:   # the supervisor died before the prctl: nobody to signal
            os._exit(1)

    return preexec


# Python names neither; this is their value in asm-generic (x86-64, arm64).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
TIMESPEC = struct.Struct("qq")


class Supervised:
    """One daemon process. `log`: a file its stderr is appended to (stdout discarded); None
    leaves both to this process's. `new_session`: a terminal's Ctrl-C reaches only the
    supervisor, which stops its children in order. `die_with_parent`: see _die_with_parent.

    The notify socket is read only in calls from the caller's thread, never in a thread of its
    own: the kernel hands a child on to each next thread of a dying parent, sending the
    die_with_parent SIGTERM each time, and a second SIGTERM kills a daemon that is already
    stopping. The kernel stamps each message as it arrives, so a late read still gives the
    right time."""

    def __init__(self, name: str, argv: list[str], notify_path: Path, *,
                 log: Path | None = None, env: dict | None = None, cwd: str | None = None,
                 new_session: bool = False, die_with_parent: bool = False):
        self.name = name
        self.argv = argv
        self.notify_path = notify_path
        self.log = log
        self.env = env or {}
        self.cwd = cwd
        self.new_session = new_session
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0     # time.time() just before the process was started
        self.notes: list[tuple[float, str]] = []   # (time.time() it arrived, message)
        self.killed = False     # the last stop had to SIGKILL it
        self._notify: socket.socket | None = None

    def start(self) -> "Supervised":
        self.notes = []
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        with contextlib.suppress(OSError):
            self._notify.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), PYTHONUNBUFFERED="1",
                   **self.env)
        preexec = _die_with_parent(os.getpid()) if self.die_with_parent else None
        self.started_at = time.time()
        try:
            with open(self.log, "ab") if self.log else contextlib.nullcontext() as log:
                self.proc = subprocess.Popen(
                    self.argv, env=env, cwd=self.cwd, start_new_session=self.new_session,
                    preexec_fn=preexec, stdout=subprocess.DEVNULL if log else None, stderr=log)
        except BaseException:
            self._close_notify()
            raise
        return self

    def receive(self, timeout: float) -> bool:
        """Reads one notify message, waiting at most `timeout` for it; False if none came."""
        if self._notify is None:
            return False
        self._notify.settimeout(timeout)
        try:
            data, ancillary, _, _ = self._notify.recvmsg(4096, socket.CMSG_SPACE(TIMESPEC.size))
        except (TimeoutError, BlockingIOError):
            return False
        when = time.time()
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS:
                seconds, nanoseconds = TIMESPEC.unpack(payload[:TIMESPEC.size])
                when = seconds + nanoseconds / 1e9
        self.notes.append((when, data.decode(errors="replace")))
        return True

    def drain(self, quiet: float = 0.05) -> list[str]:
        """Reads messages until none came for `quiet` seconds; all messages so far."""
        while self.receive(quiet):
            pass
        return self.messages

    @property
    def messages(self) -> list[str]:
        return [message for _, message in self.notes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready_at(self) -> float | None:
        """When READY=1 came (time.time()), if it came."""
        return next((t for t, message in self.notes if "READY=1" in message), None)

    def wait_ready(self, timeout: float) -> float:
        """Waits for READY=1; returns when it came (time.time())."""
        deadline = time.monotonic() + timeout
        while self.ready_at() is None:
            if self.proc.poll() is not None:
                self.drain(0)      # it may have said READY=1 just before it exited
                if self.ready_at() is None:
                    self._close_notify()   # it is gone: nobody stops it, nothing more comes
                    raise NotReady(f"{self.name} exited with status {self.proc.returncode} "
                                   f"before it was ready")
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotReady(f"{self.name} was not ready within {timeout:g}s")
            self.receive(min(left, 0.2))
        return self.ready_at()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Sends `sig` (if it still runs) and waits; SIGKILL once `timeout` has passed (then
        `killed` is set). Returns its exit status (None: never started)."""
        if self.proc is None:
            self._close_notify()
            return None
        self.killed = False
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.killed = True
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self._close_notify()
        return self.proc.returncode

    def _close_notify(self) -> None:
        """Keeps what the process said until it stopped (STOPPING=1), then lets the socket go."""
        if self._notify is None:
            return
        self.drain(0)
        self._notify.close()
        self._notify = None
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
