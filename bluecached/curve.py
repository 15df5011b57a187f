"""CURVE keys for the tcp:// host<->DPU link (ZeroMQ's authenticated encryption).

Layout under `curve_dir` (default /etc/bluecache/curve):
  server.key / server.key_secret     the daemon's certificate pair
  clients/<name>.key                 public keys of the hosts allowed to connect
  <name>.key / <name>.key_secret     a client's own pair (on the host)
"""

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


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
        raise CurveError(f"CURVE key {path} does not exist (generate keys with "
                         f"`bluecachectl keygen --curve-dir {path.parent}`)")
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
    auth.configure_curve(domain="*", location=str(clients))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def client_keys(curve_dir: Path, name: str) -> dict:
    """What client.connect needs to reach a CURVE server."""
    server_public, _ = _load(curve_dir / "server.key", need_secret=False)
    public, secret = _load(curve_dir / f"{name}.key_secret", need_secret=True)
    return {"server_public": server_public, "public": public, "secret": secret}
