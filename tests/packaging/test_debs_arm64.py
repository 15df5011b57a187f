"""bluecache-dpu, the arm64 package, for real on this amd64 machine: built natively inside an
arm64 bookworm root under qemu-user (`scripts/build-debs.sh --arch arm64`), lintian-checked,
installed with apt and Debian's arm64 dependencies into a fresh minimal arm64 root, and started
as `systemctl start bluecached` in that root booted with systemd-nspawn — every arm64 binary,
systemd included, emulated by qemu-user. A 32 MiB block goes through the daemon's protocol and
survives a restart; then bluecached runs the doca engine on the DOCA API simulator the package
ships (compiled for arm64 in the build); stop and purge behave as on the host.

The only change to the shipped unit is a drop-in with PrivateIPC=no: qemu-user cannot emulate
the IPC namespace set-up (systemd fails with "Failed to set up IPC namespacing: Input/output
error"). On a DPU the unit runs as shipped.

Needs root, a Debian mirror, qemu-user-static, binfmt-support and debootstrap
(scripts/setup.sh --test). Takes about 5-8 minutes (the build root is cached in
/var/cache/bluecache/arm64-build between runs on one machine).
"""

import shutil

import pytest
from debian_tools import ROOT, fresh_container, run, tool

pytestmark = pytest.mark.slow

# qemu-user cannot emulate IPC namespaces; a DPU runs the unit as shipped.
QEMU_DROPIN = "[Service]\nPrivateIPC=no\n"


@pytest.fixture(scope="module")
def dpu_deb(tmp_path_factory):
    out = tmp_path_factory.mktemp("debs-arm64")
    run(["bash", str(ROOT / "scripts/build-debs.sh"), "--arch", "arm64", "--out", str(out)],
        timeout=1800)
    debs = list(out.glob("bluecache-dpu_*_arm64.deb"))
    assert len(debs) == 1, sorted(p.name for p in out.iterdir())
    return out, debs[0]


def test_dpu_package_lintian_and_contents(dpu_deb):
    out, deb = dpu_deb
    changes = next(out.glob("*_arm64.changes"))
    r = run([tool("lintian"), "--fail-on", "error", str(changes)], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert run(["dpkg-deb", "-f", str(deb), "Architecture"]).stdout.strip() == "arm64"
    listing = run(["dpkg-deb", "-c", str(deb)]).stdout
    for path in ("./usr/bin/bluecached", "./usr/bin/bluecachectl",
                 "./lib/systemd/system/bluecached.service", "./etc/bluecache/bluecached.yaml",
                 "/dist-packages/bluecached/daemon.py", "./usr/share/man/man8/bluecached.8.gz",
                 "/dist-packages/bluecached/dma/_doca_sim.abi3.so"):
        assert path in listing, path
    for absent in ("hostd", "fusefs", "bluecache-hostd", "bluecache_ioctl.h"):
        assert absent not in listing, absent


@pytest.fixture
def arm64_container():
    with fresh_container("bluecache-arm64.", lambda root: run(
            ["bash", str(ROOT / "scripts/arm64-root.sh"), "--minimal", str(root)],
            timeout=1800)) as c:
        yield c


def test_dpu_package_installs_and_bluecached_runs_under_systemd(dpu_deb, arm64_container):
    _, deb = dpu_deb
    c = arm64_container
    shutil.copy(deb, c.root / "root")
    shutil.copy(ROOT / "tests/packaging/dpu_roundtrip.py", c.root / "root")
    c.chroot("sh", "-ec", "apt-get update -q && apt-get install -y -q --no-install-recommends "
             f"systemd dbus /root/{deb.name}", timeout=1800)
    c.boot()
    assert c.sh("uname -m").stdout.strip() == "aarch64"
    assert c.sh("systemctl is-enabled bluecached", check=False).stdout.strip() == "disabled"
    c.sh(f"mkdir -p /run/systemd/system/bluecached.service.d && "
         f"printf '{QEMU_DROPIN}' > /run/systemd/system/bluecached.service.d/qemu-user.conf && "
         "systemctl daemon-reload")

    c.sh("systemctl start bluecached")  # Type=notify: returns once READY=1 was sent
    status = c.sh("bluecachectl status").stdout
    assert "engine        loopback" in status, status
    assert "put: 33554432 bytes read back, identical" in \
        c.sh("python3 /root/dpu_roundtrip.py put", timeout=300).stdout

    c.sh("systemctl stop bluecached")
    assert "stopped cleanly" in c.sh("journalctl -u bluecached --no-pager").stdout
    c.sh("systemctl start bluecached")
    assert "check: 33554432 bytes read back, identical" in \
        c.sh("python3 /root/dpu_roundtrip.py check", timeout=300).stdout
    show = c.sh("systemctl show -p ActiveState -p NRestarts bluecached").stdout
    assert sorted(show.split()) == ["ActiveState=active", "NRestarts=0"], show

    # The DPU's engine: doca, here on the DOCA API simulator the package ships (arm64 build).
    c.sh("sed -i -e 's/^engine: loopback$/engine: doca/' "
         "-e 's/^  library: system$/  library: simulator/' /etc/bluecache/bluecached.yaml && "
         "systemctl restart bluecached")
    status = c.sh("bluecachectl status").stdout
    assert "engine        doca: SIMULATOR (no BlueField)" in status, status
    assert "block.bin" in c.sh("bluecachectl ls /").stdout   # the cache outlived the switch

    c.sh("apt-get purge -y -q bluecache-dpu")
    assert c.sh("pgrep -x bluecached", check=False).returncode == 1
    assert not (c.root / "etc/bluecache").exists()
    left = sorted(p.name for p in (c.root / "var/lib/bluecache").iterdir())
    assert left == ["nvme"], left
