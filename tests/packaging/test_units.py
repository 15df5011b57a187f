"""The systemd units in systemd/: they parse and verify, bluecached's sandbox stays strong, and
hostd keeps the host's mount namespace (else nobody but hostd would see /mnt/kv-cache)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
# `systemd-analyze security` exposure, in tenths (1.8 when written; 10 is the worst).
BLUECACHED_MAX_EXPOSURE = 20

# Options that give a unit its own mount namespace (systemd.exec(5)): on the FUSE unit they hide
# the mount from the rest of the system.
MOUNT_NAMESPACE_OPTIONS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "PrivateUsers", "PrivateNetwork", "PrivateIPC", "ProtectKernelTunables", "ProtectKernelModules",
    "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset", "ProtectHostname",
    "ProtectClock", "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths",
    "NoExecPaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "RootDirectory",
    "RootImage", "MountFlags", "MountAPIVFS", "StateDirectory", "CacheDirectory", "LogsDirectory",
    "RuntimeDirectory", "DynamicUser", "NetworkNamespacePath", "IPCNamespacePath",
    "LoadCredential", "SetCredential", "MountImages", "ExtensionImages", "ExtensionDirectories",
}


def _analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: apt-get install systemd"
    return path


def _settings(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    section = None
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return found


@pytest.fixture
def units(tmp_path):
    """Copies of the units whose ExecStart binaries exist (systemd-analyze checks that)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("bluecached", "bluecache-hostd"):
        stub = bindir / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    out = {}
    for unit in ("bluecached.service", "bluecache-hostd.service"):
        text = (UNITS / unit).read_text()
        assert "/usr/bin/" in text
        copy = tmp_path / unit
        copy.write_text(text.replace("/usr/bin/", f"{bindir}/"))
        out[unit] = copy
    return out


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_analyze(), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("unit", ["bluecached.service", "bluecache-hostd.service"])
def test_unit_verifies(units, unit):
    r = _run("verify", "--man=no", str(units[unit]))
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr


def test_verify_catches_a_bad_unit(units):
    """The check above can fail: a typo in a directive is reported."""
    bad = units["bluecached.service"]
    bad.write_text(bad.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    r = _run("verify", "--man=no", str(bad))
    assert "WatchdogSecs" in r.stderr


def test_bluecached_sandbox_score(units):
    r = _run("--offline=true", "security", f"--threshold={BLUECACHED_MAX_EXPOSURE}",
             str(units["bluecached.service"]))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "Overall exposure level" in r.stdout


@pytest.mark.parametrize("unit", ["bluecached.service", "bluecache-hostd.service"])
def test_notify_contract(unit):
    s = _settings(UNITS / unit)
    assert s["Service.Type"] == ["notify"]
    assert s["Service.NotifyAccess"] == ["main"]
    assert s["Service.Restart"] == ["on-failure"]
    assert s["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    config = "bluecached.yaml" if unit == "bluecached.service" else "hostd.yaml"
    assert s["Service.ExecStart"][0].endswith(f"--config /etc/bluecache/{config}")


def test_bluecached_watchdog_and_state():
    s = _settings(UNITS / "bluecached.service")
    assert s["Service.WatchdogSec"] == ["30"]
    assert s["Service.StateDirectory"] == ["bluecache"]
    assert s["Service.ProtectSystem"] == ["strict"]
    assert set(s["Service.RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET",
                                                                     "AF_INET6"}


def test_hostd_keeps_the_host_mount_namespace():
    s = _settings(UNITS / "bluecache-hostd.service")
    used = {key.split(".", 1)[1] for key in s if key.startswith("Service.")}
    assert not used & MOUNT_NAMESPACE_OPTIONS
    assert "bluecached.service" in s["Unit.Requires"][0].split()
    assert "bluecached.service" in s["Unit.After"][0].split()


def test_dpu_dropin_drops_the_dependency_on_bluecached():
    s = _settings(UNITS / "bluecache-hostd-dpu.conf")
    assert s["Unit.Requires"] == [""]
    assert s["Unit.After"][0] == ""
    assert not any("bluecached" in v for v in s["Unit.After"])


# The CUDA drop-in opens /dev and /proc to the NVIDIA driver: 2.1 when written.
BLUECACHED_CUDA_MAX_EXPOSURE = 25


@pytest.fixture
def cuda_dropin(units):
    """bluecached.service with the CUDA drop-in beside it (systemd-analyze reads <unit>.d/)."""
    unit = units["bluecached.service"]
    dropins = unit.parent / "bluecached.service.d"
    dropins.mkdir()
    (dropins / "cuda.conf").write_text((UNITS / "bluecached-cuda.conf").read_text())
    return unit, dropins / "cuda.conf"


def test_cuda_dropin_verifies_and_keeps_the_sandbox(cuda_dropin):
    unit, dropin = cuda_dropin
    r = _run("verify", "--man=no", str(unit))
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr
    r = _run("--offline=true", "security", f"--threshold={BLUECACHED_CUDA_MAX_EXPOSURE}",
             str(unit))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "char-nvidia*:rw" in r.stdout          # the drop-in was read, not just the unit
    dropin.write_text(dropin.read_text().replace("ProcSubset=", "ProcSubsett="))
    assert "ProcSubsett" in _run("verify", "--man=no", str(unit)).stderr


def test_cuda_dropin_opens_only_the_nvidia_devices():
    s = _settings(UNITS / "bluecached-cuda.conf")
    assert s["Service.PrivateDevices"] == ["no"]
    assert s["Service.DeviceAllow"] == ["char-nvidia* rw"]
    assert "Service.DevicePolicy" not in s          # the main unit's "closed" stays
    assert "Service.CapabilityBoundingSet" not in s
