"""The DPU image (arm64) on this amd64 machine: scripts/build-images.sh --arch arm64 builds
bluecache-dpu under qemu-user (as scripts/build-debs.sh does) into a debootstrapped arm64
Debian 12 root, imports it with podman and saves the OCI archive; podman then runs it, every
arm64 binary emulated through binfmt_misc. bluecached starts in its default mode, answers
bluecachectl, stores a 32 MiB block through its protocol as hostd would, persists it at SIGTERM
and serves it again after a container restart.

Needs root, podman with runc, debootstrap, qemu-user-static and binfmt-support
(scripts/setup.sh --test); skipped with the reason where podman is missing. Takes several
minutes under qemu (the arm64 build root and the image's base root are cached in
/var/cache/bluecache between runs).
"""

import json
import time
import uuid

import pytest
from debian_tools import ROOT, run
from test_images import LIMITS, pm, podman

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dpu_image(tmp_path_factory) -> str:
    podman()
    out = tmp_path_factory.mktemp("images-arm64")
    started = time.monotonic()
    r = run(["bash", str(ROOT / "scripts/build-images.sh"), "--arch", "arm64", "--out", str(out)],
            timeout=3000)
    print(f"build-images.sh --arch arm64 took {time.monotonic() - started:.0f} s")
    archive = r.stdout.split()[-1]
    assert archive.endswith("_arm64.oci.tar") and "bluecache-dpu_" in archive, r.stdout
    _, version, _ = archive.rsplit("/", 1)[1].removesuffix(".oci.tar").split("_")
    return f"localhost/bluecache-dpu:{version}"


def test_dpu_image_runs_bluecached_under_qemu(dpu_image, tmp_path):
    info = json.loads(pm("image", "inspect", dpu_image).stdout)[0]
    assert info["Architecture"] == "arm64"
    assert "BLUECACHE_DEFAULT_MODE=bluecached" in info["Config"]["Env"]
    print(f"image {dpu_image}: {info['Size'] >> 20} MiB")
    state = tmp_path / "state"
    state.mkdir()
    name = f"bc-dpu-{uuid.uuid4().hex[:8]}"
    try:
        pm("run", "-d", *LIMITS, "--name", name, "-v", f"{state}:/var/lib/bluecache",
           "-v", f"{ROOT / 'tests/packaging'}:/t:ro", dpu_image,
           "--set", "tiers.dram.prefault=0", "--set", "tiers.dram.size=256MiB",
           "--set", "tiers.nvme.size=1GiB")
        assert pm("exec", name, "uname", "-m").stdout.strip() == "aarch64"
        assert pm("exec", name, "sh", "-c", "test ! -e /usr/bin/bluecache-hostd",
                  check=False).returncode == 0
        deadline = time.monotonic() + 300      # bluecached starts slowly under emulation
        while pm("exec", name, "bluecachectl", "status", check=False).returncode != 0:
            assert time.monotonic() < deadline, pm("logs", name).stderr
            time.sleep(2)
        assert "engine        loopback" in pm("exec", name, "bluecachectl", "status").stdout
        assert "put: 33554432 bytes read back, identical" in \
            pm("exec", name, "python3", "/t/dpu_roundtrip.py", "put", timeout=600).stdout
        pm("restart", "-t", "120", name, timeout=300)
        deadline = time.monotonic() + 300
        while pm("exec", name, "bluecachectl", "status", check=False).returncode != 0:
            assert time.monotonic() < deadline, pm("logs", name).stderr
            time.sleep(2)
        assert "check: 33554432 bytes read back, identical" in \
            pm("exec", name, "python3", "/t/dpu_roundtrip.py", "check", timeout=600).stdout
        logs = pm("logs", name)
        assert "stopped cleanly" in logs.stdout + logs.stderr
    finally:
        pm("rm", "-f", "-t", "60", name, check=False, timeout=120)
