"""CURVE keys for the tcp:// host<->DPU link (ZeroMQ's authenticated encryption).

Layout under `curve_dir` (default /etc/bluecache/curve):
  server.key / server.key_secret     the daemon's certificate pair
  clients/<name>.key                 public keys of the hosts allowed to connect
  <name>.key / <name>.key_secret     a client's own pair (on the host)
"""

import logging
import os
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ..log_limit import LogLimiter

log = logging.getLogger("bluecached.wire.curve")


class CurveError(Exception):
    pass


def generate(curve_dir: Path, name: str) -> tuple[Path, Path]:
    """Creates a key pair `name` in curve_dir (secret file mode 0600)."""
    curve_dir.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(str(curve_dir), name)
    finally:
        os.umask(old)
    return Path(public), Path(secret)


def _load(path: Path, need_secret: bool):
    if not path.exists():
        name = path.name.removesuffix("_secret").removesuffix(".key")
        raise CurveError(f"CURVE key {path} does not exist (create it with "
                         f"`bluecachectl keygen --curve-dir {path.parent} --name {name}`)")
    public, secret = zmq.auth.load_certificate(str(path))
    if need_secret and secret is None:
        raise CurveError(f"{path} holds no secret key")
    return public, secret


def secure_server(ctx: zmq.Context, sock: zmq.Socket, curve_dir: Path) -> ThreadAuthenticator:
    """Makes `sock` a CURVE server accepting only the public keys in curve_dir/clients."""
    public, secret = _load(curve_dir / "server.key_secret", need_secret=True)
    clients = curve_dir / "clients"
    if not clients.is_dir():
        raise CurveError(f"{clients} does not exist: no client would be allowed in")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=ClientKeys(clients))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


class ClientKeys:
    """The public keys in clients/, read again whenever the directory changes: a host's key
    added (or removed) while the daemon runs counts from its next connection, no restart.
    Refused clients are logged (at most once a minute), naming the key they offered."""

    def __init__(self, clients: Path):
        self.clients = clients
        self._lock = threading.Lock()   # the authenticator's thread calls in
        self._seen = None               # the directory's mtime when last read
        self._keys: set[bytes] = set()
        self._refusals = LogLimiter(60.0)

    def _current(self) -> set[bytes]:
        mtime = self.clients.stat().st_mtime_ns
        if mtime != self._seen:
            keys = set()
            for path in sorted(self.clients.glob("*.key")):
                try:
                    keys.add(zmq.auth.load_certificate(str(path))[0])
                except (OSError, ValueError) as e:
                    log.warning("ignoring client key %s: %s", path, e)
            if self._seen is not None:
                log.info("client keys in %s changed: %d allowed", self.clients, len(keys))
            self._keys, self._seen = keys, mtime
        return self._keys

    def callback(self, domain: str, client_key: bytes) -> bool:
        with self._lock:
            try:
                allowed = client_key in self._current()
            except OSError as e:
                log.error("cannot read client keys in %s: %s", self.clients, e)
                allowed = False
        if not allowed:
            note = self._refusals.allow()
            if note is not None:
                log.warning("refused a client whose CURVE public key %s is not in %s%s",
                            client_key.decode(errors="replace"), self.clients, note)
        return allowed


def client_keys(curve_dir: Path, name: str) -> dict:
    """What client.connect needs to reach a CURVE server."""
    server_public, _ = _load(curve_dir / "server.key", need_secret=False)
    public, secret = _load(curve_dir / f"{name}.key_secret", need_secret=True)
    return {"server_public": server_public, "public": public, "secret": secret}
