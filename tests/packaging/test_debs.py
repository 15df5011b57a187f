"""The Debian packages, for real: build them, lintian them, install bluecache-host with Debian's
own dependencies into a freshly debootstrapped bookworm, boot systemd in it (systemd-nspawn),
start both units, write and read back a 32 MiB block through /mnt/kv-cache, stop (unmounts),
purge (only the NVMe tier's data stays).

Needs root, network access to a Debian mirror (debootstrap and apt) and the tools in
docs/packaging.md; a missing tool fails the test. Takes about 2-3 minutes.
"""

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _apt_mirror() -> str:
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


MIRROR = os.environ.get("BLUECACHE_DEBIAN_MIRROR") or _apt_mirror()
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
BLOCK = 32 << 20

pytestmark = pytest.mark.slow


def _tool(name: str) -> str:
    path = shutil.which(name, path=SYSTEM_PATH)
    assert path, f"{name} is missing (see docs/packaging.md for the packages the tests need)"
    return path


def _run(cmd, timeout=600, check=True, **kw) -> subprocess.CompletedProcess:
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check:
        assert r.returncode == 0, \
            f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    out = tmp_path_factory.mktemp("debs")
    _run(["bash", str(ROOT / "scripts/build-debs.sh"), "--out", str(out)],
         timeout=900)
    found = {p.name.split("_")[0]: p for p in out.glob("*.deb")}
    assert "bluecache-host" in found, sorted(found)
    return out, found


def test_lintian_reports_no_errors(debs):
    out, _ = debs
    changes = next(out.glob("*.changes"))
    r = _run([_tool("lintian"), "--fail-on", "error", str(changes)], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [line for line in r.stdout.splitlines() if line.startswith("E:")], r.stdout


def test_host_package_contents(debs):
    _, found = debs
    listing = _run(["dpkg-deb", "-c", str(found["bluecache-host"])]).stdout
    for path in ("./usr/bin/bluecached", "./usr/bin/bluecache-hostd", "./usr/bin/bluecachectl",
                 "./usr/include/bluecache_ioctl.h", "./lib/systemd/system/bluecached.service",
                 "./lib/systemd/system/bluecache-hostd.service",
                 "./etc/bluecache/bluecached.yaml", "./etc/bluecache/hostd.yaml",
                 "/dist-packages/hostd/_fuse_shim.abi3.so",
                 "/dist-packages/bluecached/dma/_doca_sim.abi3.so",
                 "/dist-packages/fusefs/operations.py"):
        assert path in listing, path
    conffiles = _run(["dpkg-deb", "-I", str(found["bluecache-host"]), "conffiles"]).stdout.split()
    assert sorted(conffiles) == ["/etc/bluecache/bluecached.yaml", "/etc/bluecache/hostd.yaml"]


class Container:
    """A debootstrapped bookworm booted with systemd-nspawn; commands run via nsenter."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = None
        self.leader = None

    def chroot(self, *cmd: str, timeout=600) -> subprocess.CompletedProcess:
        """Runs a command in the tree without booting it (host network: apt can download)."""
        return _run([_tool("systemd-nspawn"), "-q", "-D", str(self.root), "--register=no",
                     "--keep-unit", *cmd], timeout=timeout)

    def boot(self) -> None:
        self.proc = subprocess.Popen(
            [_tool("systemd-nspawn"), "-q", "-b", "-D", str(self.root), "--register=no",
             "--keep-unit", "--private-network", "--bind=/dev/fuse", "--console=pipe",
             "systemd.firstboot=off"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
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
        assert state in ("running", "degraded"), state

    def sh(self, script: str, check=True, timeout=300) -> subprocess.CompletedProcess:
        return _run([_tool("nsenter"), "-t", str(self.leader), "-a", "sh", "-ec", script],
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


@pytest.fixture
def container(debs):
    _tool("debootstrap")
    work = Path(tempfile.mkdtemp(prefix="bluecache-nspawn."))
    root = work / "root"
    c = Container(root)
    try:
        _run([_tool("debootstrap"), "--variant=minbase", "--include=systemd,dbus", "bookworm",
              str(root), MIRROR], timeout=900)
        yield c
    finally:
        c.close()
        shutil.rmtree(work, ignore_errors=True)


def test_install_start_io_stop_purge(debs, container):
    _, found = debs
    shutil.copy(found["bluecache-host"], container.root / "root")
    deb = f"/root/{found['bluecache-host'].name}"
    # Installed with Debian's own dependencies, from the mirror.
    container.chroot("sh", "-ec", f"apt-get update -q && apt-get install -y -q "
                     f"--no-install-recommends {deb}")
    container.boot()
    c = container
    c.sh("python3 -c 'import bluecached.daemon, hostd.daemon' && bluecachectl --help >/dev/null")
    assert c.sh("systemctl is-enabled bluecached bluecache-hostd", check=False).stdout.split() \
        == ["disabled", "disabled"]

    # A short watchdog proves the daemon pings it (30 s in the unit).
    dropin = "/run/systemd/system/bluecached.service.d"
    c.sh(f"mkdir -p {dropin} && printf '[Service]\\nWatchdogSec=2\\n' > {dropin}/wd.conf && "
         "systemctl daemon-reload")
    c.sh("systemctl start bluecached bluecache-hostd")
    assert "fuse.bluecache" in c.sh("findmnt -n -o FSTYPE /mnt/kv-cache").stdout

    c.sh(f"head -c {BLOCK} /dev/urandom > /root/block && cp /root/block /mnt/kv-cache/b.tmp && "
         "mv /mnt/kv-cache/b.tmp /mnt/kv-cache/block && sync /mnt/kv-cache/block && "
         "echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true")
    c.sh("cmp /root/block /mnt/kv-cache/block")
    assert c.sh("stat -c %s /mnt/kv-cache/block").stdout.strip() == str(BLOCK)
    assert "files               1" in c.sh("bluecachectl stats").stdout
    c.sh("systemctl reload bluecached")

    time.sleep(5)  # more than twice the test watchdog
    show = c.sh("systemctl show -p ActiveState -p NRestarts -p WatchdogUSec bluecached").stdout
    assert sorted(show.split()) == ["ActiveState=active", "NRestarts=0", "WatchdogUSec=2s"], show
    assert c.sh("systemctl is-active bluecache-hostd").stdout.strip() == "active"

    c.sh("systemctl stop bluecache-hostd bluecached")
    assert c.sh("findmnt /mnt/kv-cache", check=False).returncode == 1
    log = c.sh("journalctl -u bluecached -u bluecache-hostd --no-pager").stdout
    assert "stopped cleanly" in log

    # The block survives a restart (it was persisted to NVMe on SIGTERM).
    c.sh("systemctl start bluecache-hostd && cmp /root/block /mnt/kv-cache/block")
    c.sh("systemctl enable bluecached bluecache-hostd")

    # purge: stops the units, removes configs, state and enablement; keeps the NVMe tier.
    c.sh("apt-get purge -y -q bluecache-host")
    assert c.sh("findmnt /mnt/kv-cache", check=False).returncode == 1
    assert c.sh("pgrep -x bluecached || pgrep -x bluecache-hostd", check=False).returncode == 1
    assert not (c.root / "etc/bluecache").exists()
    left = sorted(str(p.relative_to(c.root)) for p in (c.root / "var/lib/bluecache").iterdir())
    assert left == ["var/lib/bluecache/nvme"], left
    assert any((c.root / "var/lib/bluecache/nvme").iterdir())
    leftovers = c.sh("find / -xdev \\( -path /proc -o -path /sys -o -path /var/lib/bluecache "
                     "-o -path /root \\) -prune -o -name '*bluecache*' -print").stdout.split()
    assert leftovers == [], leftovers
    assert "bluecache-host" not in c.sh("dpkg -l").stdout
