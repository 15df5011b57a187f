"""A single-node Ceph cluster (mon, mgr, one OSD, radosgw) as plain processes under a directory.

What the remote tier's tests and bench/remote_bench.py run against: a real S3 endpoint served
by Ceph's radosgw, on loopback, on free ports. No systemd: each daemon is started in the
foreground (`-f`) as a child of this process, its pid recorded, and stopped in reverse order.
The recipe is ../shared/facts/remote-tier.md (Debian's Ceph 16.2 packages; `scripts/setup.sh
--test` installs them).

    python tests/ceph_cluster.py /tmp/ceph     # start one and print its S3 endpoint; Ctrl-C stops

The OSD keeps objects in memory (memstore, `memstore_bytes`): this proves the S3 protocol path
and the failure handling, not Ceph's durability.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ACCESS_KEY = "BLUECACHETESTKEY0001"
SECRET_KEY = "bluecache-test-secret-key-not-for-production"
REGION = "us-east-1"


class CephError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> str | None:
    """None if the Ceph binaries are installed, else what is missing."""
    missing = [b for b in ("ceph-mon", "ceph-mgr", "ceph-osd", "radosgw", "radosgw-admin",
                           "ceph", "ceph-authtool", "monmaptool", "uuidgen")
               if shutil.which(b) is None]
    return f"missing {' '.join(missing)} (scripts/setup.sh --test installs them)" \
        if missing else None


class CephCluster:
    """Start with `start()`, stop with `stop()` (or use it as a context manager)."""

    def __init__(self, root: Path, memstore_bytes: int = 3 << 30):
        self.root = Path(root)
        self.memstore_bytes = memstore_bytes
        self.conf = self.root / "ceph.conf"
        self.procs: list[tuple[str, subprocess.Popen]] = []   # start order
        self.rgw: subprocess.Popen | None = None
        self.mon_port = self.mon_v1_port = self.rgw_port = 0

    # -- S3 side ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def s3_settings(self, bucket: str, credentials_file: Path, **extra) -> dict:
        """bluecached's `remote:` section pointing at this cluster."""
        return {"enabled": True, "endpoint": self.endpoint, "bucket": bucket,
                "region": REGION, "credentials_file": str(credentials_file),
                "addressing_style": "path", **extra}

    def write_credentials(self, path: Path) -> Path:
        """An AWS-style credentials file, mode 0600 (bluecached refuses looser ones)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                    f"aws_secret_access_key = {SECRET_KEY}\n")
        return path

    def s3_client(self):
        """A plain boto3 client for the cluster (what tests use to look behind bluecached)."""
        import boto3
        from botocore.config import Config

        from bluecached.tiers.s3 import checksum_options
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2},
                          **checksum_options()))

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> CephCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _env(self) -> dict:
        return dict(os.environ, CEPH_CONF=str(self.conf))

    def _run(self, *args: str, input: str | None = None, timeout: float = 60) -> str:
        cmd = [str(a) for a in args]
        try:
            done = subprocess.run(cmd, input=input, capture_output=True, text=True,
                                  timeout=timeout, env=self._env())
        except subprocess.TimeoutExpired:
            raise CephError(f"{' '.join(cmd)} did not finish in {timeout}s") from None
        if done.returncode:
            raise CephError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def ceph(self, *args: str, input: str | None = None, timeout: float = 30) -> str:
        return self._run("ceph", "-c", self.conf, "--connect-timeout", "10", *args,
                         input=input, timeout=timeout)

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.stderr", "ab")  # noqa: SIM115 (child owns it)
        with log:
            proc = subprocess.Popen([*args, "-f", "-c", str(self.conf)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, env=self._env(),
                                    start_new_session=True)
        self.procs.append((name, proc))
        (self.root / "pids").mkdir(exist_ok=True)
        (self.root / "pids" / name).write_text(f"{proc.pid}\n")
        return proc

    def _wait(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise CephError(f"{name} exited with {proc.returncode} while waiting for "
                                    f"{what}; see {self.root / 'log'}")
            try:
                if check():
                    return
            except CephError:
                pass
            if time.monotonic() > deadline:
                raise CephError(f"timed out after {timeout}s waiting for {what}; "
                                f"see {self.root / 'log'}")
            time.sleep(0.25)

    def _write_conf(self, fsid: str) -> None:
        r = self.root
        self.conf.write_text(f"""[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{self.mon_port},v1:127.0.0.1:{self.mon_v1_port}]
public_network = 127.0.0.0/8
ms_bind_ipv6 = false
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 1000
mon_data_avail_warn = 1
mon_data_avail_crit = 0
auth_allow_insecure_global_id_reclaim = false
run_dir = {r}/run
admin_socket = {r}/run/$cluster-$name.asok
pid_file = {r}/run/$cluster-$name.pid
log_file = {r}/log/$cluster-$name.log
crash_dir = {r}/crash
log_to_stderr = false
err_to_stderr = true

[mon]
mon_data = {r}/mon/$cluster-$id
mon_cluster_log_file = {r}/log/$cluster.cluster.log

[mgr]
mgr_data = {r}/mgr/$cluster-$id
keyring = {r}/mgr/$cluster-$id/keyring
mgr_disabled_modules = dashboard,prometheus,restful

[osd]
osd_data = {r}/osd/$cluster-$id
keyring = {r}/osd/$cluster-$id/keyring
osd_objectstore = memstore
memstore_device_bytes = {self.memstore_bytes}
osd_memory_target = 1073741824

[client]
keyring = {r}/admin.keyring

[client.rgw.a]
keyring = {r}/rgw.keyring
rgw_frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw_data = {r}/rgw
rgw_dns_name = localhost
""")

    def start(self, timeout: float = 120) -> CephCluster:
        problem = available()
        if problem:
            raise CephError(problem)
        r = self.root
        for sub in ("run", "log", "crash", "mon", "mgr", "osd", "rgw"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        self.mon_port, self.mon_v1_port, self.rgw_port = _free_port(), _free_port(), _free_port()
        fsid = str(uuid.uuid4())
        self._write_conf(fsid)
        try:
            self._bootstrap(fsid, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _bootstrap(self, fsid: str, timeout: float) -> None:
        r = self.root
        mon_keyring, admin_keyring = r / "mon.keyring", r / "admin.keyring"
        self._run("ceph-authtool", "--create-keyring", mon_keyring, "--gen-key", "-n", "mon.",
                  "--cap", "mon", "allow *")
        self._run("ceph-authtool", "--create-keyring", admin_keyring, "--gen-key", "-n",
                  "client.admin", "--cap", "mon", "allow *", "--cap", "osd", "allow *",
                  "--cap", "mds", "allow *", "--cap", "mgr", "allow *")
        self._run("ceph-authtool", mon_keyring, "--import-keyring", admin_keyring)
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a",
                  f"[v2:127.0.0.1:{self.mon_port},v1:127.0.0.1:{self.mon_v1_port}]",
                  r / "monmap")
        self._run("ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", r / "monmap",
                  "--keyring", mon_keyring)
        self._spawn("mon.a", "ceph-mon", "-i", "a")
        self._wait("the monitor", lambda: bool(self.ceph("mon", "stat")), timeout)

        mgr_dir = r / "mgr" / "ceph-x"
        mgr_dir.mkdir(parents=True, exist_ok=True)
        self.ceph("auth", "get-or-create", "mgr.x", "mon", "allow profile mgr", "osd", "allow *",
                  "mds", "allow *", "-o", str(mgr_dir / "keyring"))
        self._spawn("mgr.x", "ceph-mgr", "-i", "x")

        osd_uuid = str(uuid.uuid4())
        secret = self._run("ceph-authtool", "--gen-print-key").strip()
        osd_id = self.ceph("osd", "new", osd_uuid, "-i", "-",
                           input=json.dumps({"cephx_secret": secret})).strip()
        osd_dir = r / "osd" / f"ceph-{osd_id}"
        osd_dir.mkdir(parents=True, exist_ok=True)
        self._run("ceph-authtool", "--create-keyring", osd_dir / "keyring", "--name",
                  f"osd.{osd_id}", "--add-key", secret)
        self._run("ceph-osd", "-c", self.conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn(f"osd.{osd_id}", "ceph-osd", "-i", osd_id)
        self._wait("the OSD to be up and in", lambda: self._osd_up_in(), timeout)

        self.ceph("auth", "get-or-create", "client.rgw.a", "mon", "allow rw", "osd", "allow rwx",
                  "mgr", "allow rw", "-o", str(r / "rgw.keyring"))
        self.start_rgw(timeout)
        self._run("radosgw-admin", "-c", self.conf, "user", "create", "--uid=bluecache",
                  "--display-name=bluecache tests", f"--access-key={ACCESS_KEY}",
                  f"--secret={SECRET_KEY}")
        try:
            self._wait("HEALTH_OK", lambda: self.ceph("health").startswith("HEALTH_OK"), timeout)
        except CephError as e:
            raise CephError(f"{e}\n{self.ceph('health', 'detail')}") from None

    def _osd_up_in(self) -> bool:
        stat = json.loads(self.ceph("osd", "stat", "-f", "json"))
        stat = stat.get("osdmap", stat)  # the layout changed between releases
        return stat.get("num_up_osds", 0) >= 1 and stat.get("num_in_osds", 0) >= 1

    def _rgw_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True   # an S3 error document is an answer
        except OSError:
            return False

    def start_rgw(self, timeout: float = 60) -> None:
        """Starts radosgw (again, after `kill_rgw`) and waits until it answers HTTP."""
        self.rgw = self._spawn("rgw.a", "radosgw", "-n", "client.rgw.a")
        self._wait("radosgw to answer HTTP", self._rgw_answers, timeout)

    def kill_rgw(self) -> None:
        """SIGKILLs radosgw (the S3 endpoint goes away; the cluster behind it stays)."""
        proc = self.rgw
        if proc is None:
            return
        proc.kill()
        proc.wait(30)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]
        self.rgw = None

    def stop(self, timeout: float = 30) -> None:
        """Stops every daemon, last started first: SIGTERM, then SIGKILL after `timeout`."""
        while self.procs:
            name, proc = self.procs.pop()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
            with contextlib.suppress(FileNotFoundError):
                (self.root / "pids" / name).unlink()
        self.rgw = None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    with CephCluster(Path(argv[1])) as cluster:
        print(f"S3 endpoint {cluster.endpoint} access key {ACCESS_KEY} secret {SECRET_KEY}",
              flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
