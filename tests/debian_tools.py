"""Shared by the Debian packaging tests: the mirror apt uses, tools from the system's PATH
(never a venv's), and a debootstrapped root booted with systemd-nspawn."""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def apt_mirror() -> str:
    """The Debian mirror this machine's apt already uses (deb822 or one-line sources)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    listing = Path("/etc/apt/sources.list")
    if listing.exists():
        for line in listing.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    raise AssertionError("no Debian mirror in apt's sources: set BLUECACHE_DEBIAN_MIRROR")


MIRROR = os.environ.get("BLUECACHE_DEBIAN_MIRROR") or apt_mirror()
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def tool(name: str) -> str:
    path = shutil.which(name, path=SYSTEM_PATH)
    assert path, f"{name} is missing (see docs/packaging.md for the packages the tests need)"
    return path


def run(cmd, timeout=600, check=True, **kw) -> subprocess.CompletedProcess:
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive",
           "BLUECACHE_DEBIAN_MIRROR": MIRROR}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check:
        assert r.returncode == 0, \
            f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


class Container:
    """A debootstrapped bookworm booted with systemd-nspawn; commands run via nsenter."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = None
        self.leader = None

    def chroot(self, *cmd: str, timeout=600) -> subprocess.CompletedProcess:
        """Runs a command in the tree without booting it (host network: apt can download)."""
        return run([tool("systemd-nspawn"), "-q", "-D", str(self.root), "--register=no",
                    "--keep-unit", *cmd], timeout=timeout)

    def boot(self) -> None:
        self.proc = subprocess.Popen(
            [tool("systemd-nspawn"), "-q", "-b", "-D", str(self.root), "--register=no",
             "--keep-unit", "--private-network", "--bind=/dev/fuse", "--console=pipe",
             "systemd.firstboot=off"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Generous: a loaded 2-core machine, or qemu-user emulating every arm64 binary.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and self.leader is None:
            assert self.proc.poll() is None, "systemd-nspawn exited"
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            self.leader = int(pids[0]) if pids else None
            time.sleep(0.2)
        assert self.leader, "container did not start"
        state = ""
        while time.monotonic() < deadline and state not in ("running", "degraded"):
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()
            time.sleep(0.5)
        assert state in ("running", "degraded"), \
            f"systemd in the container is {state!r} after 180 s:\n" + \
            self.sh("systemctl list-jobs --no-pager; systemctl --failed --no-pager",
                    check=False).stdout

    def sh(self, script: str, check=True, timeout=300) -> subprocess.CompletedProcess:
        return run([tool("nsenter"), "-t", str(self.leader), "-a", "sh", "-ec", script],
                    check=check, timeout=timeout)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.sh("systemctl poweroff", check=False, timeout=30)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def fresh_container(prefix: str, make_root):
    """A Container in a new temp dir; `make_root(root)` fills it. Stopped and removed after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    c = Container(work / "root")
    try:
        make_root(c.root)
        yield c
    finally:
        c.close()
        kv_cache = c.root / "mnt/kv-cache"     # hostd made it immutable (see hostd/mount.py)
        if kv_cache.is_dir():
            subprocess.run(["chattr", "-i", str(kv_cache)], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
