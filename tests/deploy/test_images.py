"""The container images, for real: scripts/build-images.sh builds the host image (a
debootstrapped Debian 12 root with bluecache-host installed, imported with podman, saved as an
OCI archive) once for this module; then it runs as Kubernetes would run it. The node's mount
parent is a shared mount; the cache container gets it `rshared` (Kubernetes' Bidirectional) with
--privileged and /dev/fuse, and a consumer container gets it `rslave` (HostToContainer), as the
vLLM pods of docs/kubernetes.md do. The consumer runs llm-d's FS backend sequence
(tests/connectors.py) byte-exact through the mount, and keeps working, never restarted itself,
when the cache container is restarted, killed and started again, or stopped (its writes then
fail on hostd's guarded directory instead of landing on the node's disk). Both shapes: the
embedded entrypoint (both daemons under its supervisor) and the two-container pod of
deploy/kubernetes/overlays/embedded (bluecached unprivileged, hostd privileged), each with the
manifests' own config files.

Needs root and podman with runc (scripts/setup.sh --test installs them; skipped with the reason
where podman is missing). The podman here runs with runc and lowered rlimits (crun fails on this
kind of machine, and the session cannot raise hard limits: ../shared/facts/containers.md).
About 2 minutes, plus about 1 for the base root the first time on a machine.
"""

import hashlib
import json
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from debian_tools import ROOT, run

pytestmark = pytest.mark.slow

KUBE = ROOT / "deploy/kubernetes"
HOSTD_CONFIG = KUBE / "base/config/hostd.yaml"
CACHE_CONFIG = KUBE / "overlays/embedded/config/bluecached.yaml"
PARENT = "/mnt/bluecache"                 # the manifests' hostPath, inside the containers too
MOUNT = PARENT + "/kv-cache"
# Smaller than the manifests' tiers, for a shared CI machine; everything else as configured.
SMALL = "--set tiers.dram.prefault=0 --set tiers.dram.size=1GiB --set tiers.nvme.size=2GiB"
MiB = 1 << 20


def podman() -> str:
    path = shutil.which("podman")
    if path is None:
        pytest.skip("podman is not installed (scripts/setup.sh --test installs Debian's podman "
                    "and runc)")
    return path


def pm(*args: str, check=True, timeout=300) -> subprocess.CompletedProcess:
    return run([podman(), "--runtime", "runc", *args], check=check, timeout=timeout)


# What every container here gets: rlimits this session can set, no network (the daemons talk
# over unix sockets; metrics are asked from inside).
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "--network", "none"]
RUN = ["run", "-d", *LIMITS]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    podman()
    out = tmp_path_factory.mktemp("images")
    started = time.monotonic()
    r = run(["bash", str(ROOT / "scripts/build-images.sh"), "--out", str(out)], timeout=1800)
    print(f"build-images.sh took {time.monotonic() - started:.0f} s")
    archive = Path(r.stdout.split()[-1])
    assert archive.exists() and archive.parent == out, r.stdout
    # bluecache-host_VERSION_amd64.oci.tar -> localhost/bluecache-host:VERSION
    _, version, _ = archive.name.removesuffix(".oci.tar").split("_")
    with tarfile.open(archive) as t:
        names = t.getnames()
    assert "index.json" in names and "oci-layout" in names, names[:10]
    return f"localhost/bluecache-host:{version}"


class Node:
    """The node's side: a shared mount parent (as / is on a systemd host), the state
    directory, and the containers started on it (removed at the end)."""

    def __init__(self, base: Path, image: str):
        self.image = image
        self.parent = base / "mnt-bluecache"
        self.state = base / "var-lib-bluecache"
        self.parent.mkdir()
        self.state.mkdir()
        run(["mount", "--bind", str(self.parent), str(self.parent)])
        run(["mount", "--make-shared", str(self.parent)])
        self.names: list[str] = []

    def start(self, role: str, *args: str, cache=True, mode: str | None = None) -> str:
        name = f"bc-{role}-{uuid.uuid4().hex[:8]}"
        opts = [*RUN, "--name", name]
        if cache:
            opts += ["-v", f"{self.state}:/var/lib/bluecache",
                     "-v", f"{HOSTD_CONFIG}:/etc/bluecache-config/hostd.yaml:ro",
                     "-v", f"{CACHE_CONFIG}:/etc/bluecache-config/bluecached.yaml:ro",
                     "-e", "HOSTD_CONFIG=/etc/bluecache-config/hostd.yaml",
                     "-e", "BLUECACHED_CONFIG=/etc/bluecache-config/bluecached.yaml",
                     "-e", f"BLUECACHED_ARGS={SMALL}"]
        pm(*opts, *args, self.image, *([mode] if mode else []))
        self.names.append(name)
        return name

    def start_consumer(self) -> str:
        """A vLLM pod's stand-in: the parent with HostToContainer, the connectors' code."""
        return self.start("consumer", "-v", f"{self.parent}:{PARENT}:rslave",
                          "-v", f"{ROOT / 'tests'}:/tests:ro", "--entrypoint", "sleep",
                          cache=False, mode="infinity")

    def mounted_on_node(self) -> bool:
        target = str(self.parent / "kv-cache")
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == target and fields[fields.index("-") + 1] == "fuse.bluecache":
                return True
        return False

    def close(self) -> None:
        for name in reversed(self.names):
            # The consumer's sleep ignores SIGTERM (pid 1); the cache's daemons stop cleanly.
            grace = "0" if name.startswith("bc-consumer-") else "60"
            pm("rm", "-f", "-t", grace, name, check=False, timeout=120)
        run(["umount", "-R", "-l", str(self.parent)], check=False)
        kv = self.parent / "kv-cache"
        if kv.is_dir():    # hostd's guard: immutable, mode 000
            run(["chattr", "-i", str(kv)], check=False)


@pytest.fixture
def node(image, tmp_path):
    n = Node(tmp_path, image)
    yield n
    n.close()


def sh(name: str, script: str, check=True, timeout=300) -> subprocess.CompletedProcess:
    return pm("exec", name, "sh", "-c", script, check=check, timeout=timeout)


def wait_served(node: Node, consumer: str, timeout=120) -> None:
    """The cache's entrypoint check (what the vLLM example's init container runs), in the
    consumer, and the mount on the node."""
    r = pm("exec", "-e", f"BLUECACHE_WAIT_TIMEOUT={timeout}", consumer,
           "bluecache-entrypoint", "wait-mount", MOUNT, check=False, timeout=timeout + 30)
    assert r.returncode == 0, r.stderr
    assert node.mounted_on_node()


# The llm-d FS backend's syscall sequence, run inside the consumer: stores (or finds) each block,
# reads every one back, prints the SHA-256 of what it read.
LLMD = r"""
import hashlib, json, sys
sys.path.insert(0, "/tests")
from connectors import block_name, llmd_read, llmd_write
root, first, count, size = sys.argv[1], *map(int, sys.argv[2:])
out = {}
for i in range(first, first + count):
    data = hashlib.sha256(b"%d" % i).digest() * (size // 32)
    stored = llmd_write(root, block_name(i), data, "c%d" % i)
    got = llmd_read(root, block_name(i))
    out[block_name(i)] = [stored, hashlib.sha256(got).hexdigest(), len(got)]
print(json.dumps(out))
"""


def expected(first: int, count: int, size: int) -> dict[str, str]:
    from connectors import block_name
    return {block_name(i): hashlib.sha256(hashlib.sha256(b"%d" % i).digest() * (size // 32))
            .hexdigest() for i in range(first, first + count)}


def llmd(consumer: str, first: int, count: int, size: int) -> dict[str, list]:
    r = pm("exec", consumer, "python3", "-c", LLMD, MOUNT, str(first), str(count), str(size))
    got = json.loads(r.stdout)
    want = expected(first, count, size)
    assert {k: v[1] for k, v in got.items()} == want           # byte-exact
    assert all(v[2] == size for v in got.values())
    return got


def consumer_started_at(consumer: str) -> str:
    return pm("inspect", "-f", "{{.State.StartedAt}}", consumer).stdout.strip()


def http_status(container: str, port: int, path: str) -> int:
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=10).status)\n"
            "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    return int(pm("exec", container, "python3", "-c", code,
                  f"http://127.0.0.1:{port}{path}").stdout)


def test_image_contents(image):
    info = json.loads(pm("image", "inspect", image).stdout)[0]
    assert info["Config"]["Entrypoint"] == ["/usr/local/bin/bluecache-entrypoint"]
    assert "BLUECACHE_DEFAULT_MODE=embedded" in info["Config"]["Env"]
    assert info["Architecture"] == "amd64"
    size = info["Size"]
    print(f"image {image}: {size / MiB:.0f} MiB")
    assert size < 400 * MiB, size
    name = f"bc-probe-{uuid.uuid4().hex[:8]}"
    try:
        r = pm("run", "--rm", "--name", name, *LIMITS, image, "sh", "-c",
               "bluecached --version; bluecachectl --help >/dev/null && "
               "python3 -c 'import hostd.daemon, bluecached.daemon, fusefs.operations' && "
               "dpkg -s bluecache-host | grep ^Version; ls /var/lib/apt/lists | wc -l; "
               "test -x /usr/bin/bluecache-hostd && echo hostd")
        lines = r.stdout.split("\n")
        assert lines[0].startswith("bluecached ")
        assert lines[1].startswith("Version: ") and lines[2] == "0" and lines[3] == "hostd"
        # The guard's check outside a mount says no, and a bad mode names the modes.
        assert pm("run", "--rm", *LIMITS, image, "check-mount", "/tmp",
                  check=False).returncode == 1
        r = pm("run", "--rm", *LIMITS, "-e", "BLUECACHE_MODE=nonsense", image,
               check=False)
        assert r.returncode == 2 and "embedded, hostd, bluecached" in r.stderr
    finally:
        pm("rm", "-f", name, check=False)


def test_embedded_container_serves_a_consumer_across_restarts(node):
    consumer = node.start_consumer()
    started = consumer_started_at(consumer)
    cache = node.start("embedded", "--privileged", "--device", "/dev/fuse",
                       "-v", f"{node.parent}:{PARENT}:rshared")
    wait_served(node, consumer)

    # llm-d's sequence: 4 blocks of 32 MiB (Llama-3.1-8B, 256 tokens) and 8 of 1 MiB; the
    # second pass over the same names takes the dedup path (found, atime touched).
    first = llmd(consumer, 0, 4, 32 * MiB)
    assert all(v[0] for v in first.values())
    llmd(consumer, 100, 8, MiB)
    assert not any(v[0] for v in llmd(consumer, 0, 4, 32 * MiB).values())
    # The node sees the same bytes under its own path (Bidirectional propagation).
    for rel, digest in expected(0, 4, 32 * MiB).items():
        data = (node.parent / "kv-cache" / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
    assert "files               12" in sh(cache, "bluecachectl stats").stdout
    # Metrics and probes answer on the configured ports (0.0.0.0: the pod network).
    assert http_status(cache, 9464, "/metrics") == 200
    assert http_status(cache, 9464, "/readyz") == 200
    assert http_status(cache, 9465, "/readyz") == 200

    # A graceful restart (SIGTERM: hostd unmounts, bluecached persists): the consumer, not
    # restarted, sees the new mount and every block.
    pm("restart", "-t", "120", cache, timeout=300)
    wait_served(node, consumer)
    llmd(consumer, 0, 4, 32 * MiB)
    llmd(consumer, 100, 8, MiB)
    log = pm("logs", cache).stderr + pm("logs", cache).stdout
    assert "stopped cleanly" in log

    # Killed (SIGKILL: the mount left dead on the node), then started: hostd clears the dead
    # mount and mounts again; the consumer reads through the new one.
    pm("kill", "-s", "KILL", cache)
    pm("wait", cache, check=False)
    r = sh(consumer, f"ls {MOUNT} 2>&1", check=False)      # (a stat may be cached)
    assert r.returncode != 0 and "not connected" in r.stdout, r.stdout
    pm("start", cache)
    wait_served(node, consumer)
    llmd(consumer, 0, 4, 32 * MiB)
    llmd(consumer, 200, 2, 32 * MiB)        # and writes new blocks

    # Stopped: nothing is mounted, the check says so, and a write in the consumer fails on the
    # guarded directory instead of landing on the node's disk.
    pm("stop", "-t", "120", cache, timeout=300)
    assert pm("inspect", "-f", "{{.State.ExitCode}}", cache).stdout.strip() == "0"
    assert not node.mounted_on_node()
    assert pm("exec", consumer, "bluecache-entrypoint", "check-mount", MOUNT,
              check=False).returncode == 1
    r = pm("exec", consumer, "python3", "-c", LLMD, MOUNT, "300", "1", str(MiB), check=False)
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    assert sorted(p.name for p in (node.parent / "kv-cache").iterdir()) == []
    pm("start", cache)
    wait_served(node, consumer)
    llmd(consumer, 200, 2, 32 * MiB)
    assert consumer_started_at(consumer) == started     # never restarted


def test_two_container_pod_shape(node):
    """deploy/kubernetes/overlays/embedded's pod: bluecached unprivileged (no capabilities,
    read-only root), hostd privileged, sharing the node's state directory; each restarts alone."""
    consumer = node.start_consumer()
    daemon = node.start("bluecached", "--cap-drop", "ALL", "--security-opt",
                        "no-new-privileges", "--read-only", "--tmpfs", "/tmp", mode="bluecached")
    hostd = node.start("hostd", "--privileged", "--device", "/dev/fuse",
                       "-v", f"{node.parent}:{PARENT}:rshared", mode="hostd")
    wait_served(node, consumer)
    llmd(consumer, 0, 2, 32 * MiB)
    assert http_status(daemon, 9464, "/readyz") == 200
    assert http_status(hostd, 9465, "/readyz") == 200

    pm("restart", "-t", "120", daemon, timeout=300)     # the mount stays; hostd reconnects
    assert node.mounted_on_node()
    llmd(consumer, 0, 2, 32 * MiB)
    pm("restart", "-t", "120", hostd, timeout=300)      # a new mount, seen by the consumer
    wait_served(node, consumer)
    llmd(consumer, 0, 2, 32 * MiB)
    llmd(consumer, 10, 2, 32 * MiB)
