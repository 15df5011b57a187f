"""The Debian packages, for real: build them, lintian them, install bluecache-host with Debian's
own dependencies into a freshly debootstrapped bookworm, boot systemd in it (systemd-nspawn),
start both units, write and read back a 32 MiB block through /mnt/kv-cache, stop (unmounts),
purge (only the NVMe tier's data stays; the guarded mountpoint goes).

Needs root, network access to a Debian mirror (debootstrap and apt) and the tools in
docs/packaging.md; a missing tool fails the test. Takes about 2-3 minutes.
"""

import shutil
import time

import pytest
from debian_tools import MIRROR, ROOT, fresh_container, run, tool

BLOCK = 32 << 20

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    out = tmp_path_factory.mktemp("debs")
    run(["bash", str(ROOT / "scripts/build-debs.sh"), "--out", str(out)], timeout=900)
    found = {p.name.split("_")[0]: p for p in out.glob("*.deb")}
    assert "bluecache-host" in found, sorted(found)
    return out, found


def test_lintian_reports_no_errors(debs):
    out, _ = debs
    changes = next(out.glob("*.changes"))
    r = run([tool("lintian"), "--fail-on", "error", str(changes)], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [line for line in r.stdout.splitlines() if line.startswith("E:")], r.stdout


def test_host_package_contents(debs):
    _, found = debs
    listing = run(["dpkg-deb", "-c", str(found["bluecache-host"])]).stdout
    for path in ("./usr/bin/bluecached", "./usr/bin/bluecache-hostd", "./usr/bin/bluecachectl",
                 "./usr/include/bluecache_ioctl.h", "./lib/systemd/system/bluecached.service",
                 "./lib/systemd/system/bluecache-hostd.service",
                 "./etc/bluecache/bluecached.yaml", "./etc/bluecache/hostd.yaml",
                 "/dist-packages/hostd/_fuse_shim.abi3.so",
                 "/dist-packages/bluecached/dma/_doca_sim.abi3.so",
                 "/dist-packages/fusefs/operations.py",
                 "./usr/share/man/man8/bluecached.8.gz", "./usr/share/man/man8/bluecachectl.8.gz",
                 "./usr/share/man/man8/bluecache-hostd.8.gz"):
        assert path in listing, path
    conffiles = run(["dpkg-deb", "-I", str(found["bluecache-host"]), "conffiles"]).stdout.split()
    assert sorted(conffiles) == ["/etc/bluecache/bluecached.yaml", "/etc/bluecache/hostd.yaml"]


@pytest.fixture
def container(debs):
    with fresh_container("bluecache-nspawn.", lambda root: run(
            [tool("debootstrap"), "--variant=minbase", "--include=systemd,dbus", "bookworm",
             str(root), MIRROR], timeout=900)) as c:
        yield c


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
    # hostd left the directory under the mount guarded (operations.md): immutable, mode 000.
    assert "i" in c.sh("lsattr -d /mnt/kv-cache").stdout.split()[0]
    assert c.sh("stat -c %a /mnt/kv-cache").stdout.strip() == "0"
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
    # The guard lifted and the (empty) mountpoint removed: nothing immutable is left behind.
    assert not (c.root / "mnt/kv-cache").exists(), \
        c.sh("lsattr -d /mnt/kv-cache; ls -ld /mnt/kv-cache", check=False).stdout
    left = sorted(str(p.relative_to(c.root)) for p in (c.root / "var/lib/bluecache").iterdir())
    assert left == ["var/lib/bluecache/nvme"], left
    assert any((c.root / "var/lib/bluecache/nvme").iterdir())
    leftovers = c.sh("find / -xdev \\( -path /proc -o -path /sys -o -path /var/lib/bluecache "
                     "-o -path /root \\) -prune -o -name '*bluecache*' -print").stdout.split()
    assert leftovers == [], leftovers
    assert "bluecache-host" not in c.sh("dpkg -l").stdout
