"""A daemon process run as systemd runs a Type=notify service: its own process, a NOTIFY_SOCKET
on which it says READY=1, and a stop that is a signal, then SIGKILL after a timeout.

One implementation for every place that starts bluecached or hostd: `bluecachectl up`
(hostd/embedded.py), the tests (tests/support.py) and the benches (bench/harness.py).
Standard library only.
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

PR_SET_PDEATHSIG = 1


class NotReady(RuntimeError):
    """The process exited before it said READY=1, or did not say it in time."""


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs `module` with this interpreter (and so this checkout)."""
    return [sys.executable, "-m", module, *args]


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


class Supervised:
    """One daemon process. `log`: a file its stderr is appended to (stdout discarded); None
    leaves both to this process's. `new_session`: a terminal's Ctrl-C reaches only the
    supervisor, which stops its children in order. `die_with_parent`: see _die_with_parent."""

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
        self.notes: list[tuple[float, str]] = []   # (time.perf_counter(), message) as received
        self.killed = False     # the last stop had to SIGKILL it
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._notify: socket.socket | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> "Supervised":
        self.notes = []
        self._ready.clear()
        self._closing.clear()
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        self._notify.settimeout(0.1)
        # Read as they come, with the time they came: a bench times READY=1, and a test reads
        # STOPPING=1 or WATCHDOG=1 after the fact.
        self._reader = threading.Thread(target=self._read_notify, name=f"{self.name}-notify",
                                        daemon=True)
        self._reader.start()
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), PYTHONUNBUFFERED="1",
                   **self.env)
        preexec = _die_with_parent(os.getpid()) if self.die_with_parent else None
        try:
            with open(self.log, "ab") if self.log else contextlib.nullcontext() as log:
                self.proc = subprocess.Popen(
                    self.argv, env=env, cwd=self.cwd, start_new_session=self.new_session,
                    preexec_fn=preexec, stdout=subprocess.DEVNULL if log else None, stderr=log)
        except BaseException:
            self._close_notify()
            raise
        return self

    def _read_notify(self) -> None:
        while True:
            try:
                data = self._notify.recv(4096)
            except TimeoutError:
                if self._closing.is_set():   # the socket is drained: nothing more will come
                    return
                continue
            except OSError:
                return
            message = data.decode(errors="replace")
            self.notes.append((time.perf_counter(), message))
            if "READY=1" in message:
                self._ready.set()

    @property
    def messages(self) -> list[str]:
        return [message for _, message in self.notes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        """Waits for READY=1; returns when it came (time.perf_counter())."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.02):
            if self.proc.poll() is not None and not self._ready.wait(0.2):
                raise NotReady(f"{self.name} exited with status {self.proc.returncode} before "
                               f"it was ready")
            if time.monotonic() > deadline:
                raise NotReady(f"{self.name} was not ready within {timeout:g}s")
        return next(t for t, message in self.notes if "READY=1" in message)

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
        if self._notify is None:
            return
        self._closing.set()
        if self._reader is not None:
            self._reader.join()
        self._notify.close()
        self._notify = None
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
