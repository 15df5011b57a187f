"""The Kubernetes manifests (deploy/kubernetes): every overlay renders with kubectl's built-in
kustomize, every rendered object validates strictly (unknown fields rejected) against the
Kubernetes 1.37 schemas with kubernetes-validate (offline), and the pieces agree with each other
and with the daemons: the configs load with the daemons' own parsers, the ports the configs
listen on are the containers' ports, the probes ask the right endpoints, the memory request is
the DRAM tier's arithmetic, the consumer's volume is the mount's parent.

Needs kubectl (with its built-in kustomize); skipped with the reason where it is missing (it is
not a Debian package: docs/kubernetes.md says where to get it)."""

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bluecached.config.schema import parse_size
from bluecached.config.table import load_config as load_bluecached_config
from hostd.config import load_config as load_hostd_config

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy/kubernetes"
OVERLAYS = ["embedded", "dpu", "remote", "monitoring"]
K8S_VERSION = "1.37.0"
PROCESS_MIB = 256     # the bluecached process itself: Python, ZeroMQ, the index (kubernetes.md)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: it is not a Debian package (docs/kubernetes.md "
                    "says where it comes from); the manifests cannot be rendered here")
    return path


def render(directory: Path) -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(KUBE / "overlays" / name) for name in OVERLAYS} | \
        {"consumer": render(KUBE / "consumer")}


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"].startswith(name))]
    assert len(found) == 1, [(o["kind"], o["metadata"]["name"]) for o in objects]
    return found[0]


def containers(objects: list[dict]) -> dict[str, dict]:
    spec = one(objects, "DaemonSet", "bluecache")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def config_file(objects: list[dict], key: str) -> dict:
    return yaml.safe_load(one(objects, "ConfigMap", "bluecache-config")["data"][key])


def test_every_overlay_renders_and_validates_strictly(rendered):
    for name, objects in rendered.items():
        kinds = sorted(o["kind"] for o in objects)
        assert kinds, name
        for o in objects:
            if o["apiVersion"].startswith("monitoring.coreos.com/"):
                continue        # a CRD's kind: no schema in Kubernetes; checked below
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    example = yaml.safe_load((KUBE / "consumer/vllm-example.yaml").read_text())
    kubernetes_validate.validate(example, K8S_VERSION, strict=True)


def test_every_container_runs_the_built_image(rendered):
    """The name scripts/build-images.sh gives the host image, with the package's version; a
    container a patch adds gets it too (an images: entry applies only where it is written)."""
    changelog = (ROOT / "packaging/debian/changelog").read_text().split("\n", 1)[0]
    version = changelog.split("(", 1)[1].split(")", 1)[0]
    for name in OVERLAYS:
        for c in containers(rendered[name]).values():
            assert c["image"] == f"localhost/bluecache-host:{version}", (name, c["name"])
            assert c["imagePullPolicy"] == "IfNotPresent"
    example = yaml.safe_load((KUBE / "consumer/vllm-example.yaml").read_text())
    (guard,) = example["spec"]["template"]["spec"]["initContainers"]
    assert guard["image"] == f"localhost/bluecache-host:{version}"


def test_strict_validation_rejects_an_unknown_field(rendered):
    """The check above has teeth: a misspelt field fails it."""
    ds = copy.deepcopy(one(rendered["embedded"], "DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["mountPropogation"] = "Bidirectional"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_the_configs_load_with_the_daemons_own_parsers(rendered, tmp_path):
    for name in OVERLAYS:
        cm = one(rendered[name], "ConfigMap", "bluecache-config")["data"]
        (tmp_path / "hostd.yaml").write_text(cm["hostd.yaml"])
        load_hostd_config(tmp_path / "hostd.yaml")
        if "bluecached.yaml" in cm:
            (tmp_path / "bluecached.yaml").write_text(cm["bluecached.yaml"])
            load_bluecached_config(tmp_path / "bluecached.yaml")
    # The remote overlay's --set values (with the ConfigMap's values put in) load too.
    objects = rendered["remote"]
    values = one(objects, "ConfigMap", "bluecache-remote")["data"]
    c = containers(objects)["bluecached"]
    env = {e["name"]: values[e["valueFrom"]["configMapKeyRef"]["key"]] for e in c["env"]
           if "configMapKeyRef" in e.get("valueFrom", {})}
    sets = [a for a in c["args"][1:] if a != "--set"]
    for k, v in env.items():
        sets = [a.replace(f"$({k})", v) for a in sets]
    assert not [a for a in sets if "$(" in a], sets
    cfg = load_bluecached_config(tmp_path / "bluecached.yaml", assignments=sets)
    assert cfg.remote.enabled and cfg.remote.endpoint == values["endpoint"]
    assert cfg.remote.credentials_file is None      # the Secret's keys come as environment
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]
               if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {"AWS_ACCESS_KEY_ID": "bluecache-s3", "AWS_SECRET_ACCESS_KEY": "bluecache-s3"}


def test_embedded_pod_privileged_only_where_the_mount_needs_it(rendered):
    for name in ("embedded", "remote", "monitoring"):
        objects = rendered[name]
        c = containers(objects)
        assert sorted(c) == ["bluecached", "hostd"], name
        assert c["hostd"]["securityContext"] == {"privileged": True}
        sc = c["bluecached"]["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        # Both see the node's state directory (sockets, NVMe tier) at the configured path.
        hostd_cfg = config_file(objects, "hostd.yaml")
        cache_cfg = config_file(objects, "bluecached.yaml")
        assert hostd_cfg["state_dir"] == cache_cfg["state_dir"]
        for container in c.values():
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["state"]["mountPath"] == cache_cfg["state_dir"]


def test_dpu_overlay_runs_hostd_alone_against_the_configmaps_endpoint(rendered, tmp_path):
    objects = rendered["dpu"]
    c = containers(objects)
    assert list(c) == ["hostd"]
    endpoints = one(objects, "ConfigMap", "bluecache-dpu")["data"]
    hostd = c["hostd"]
    env = {e["name"]: e["valueFrom"]["configMapKeyRef"] for e in hostd["env"] if "valueFrom" in e}
    assert {k: v["key"] for k, v in env.items()} == \
        {"BLUECACHED_CONTROL": "control", "BLUECACHED_EVENTS": "events"}
    assert all(v["name"].startswith("bluecache-dpu-") for v in env.values())  # the hashed name
    assert hostd["args"] == ["hostd", "--set", "daemon.control=$(BLUECACHED_CONTROL)",
                             "--set", "daemon.events=$(BLUECACHED_EVENTS)"]
    sets = [a.replace("$(BLUECACHED_CONTROL)", endpoints["control"])
             .replace("$(BLUECACHED_EVENTS)", endpoints["events"]) for a in hostd["args"][2::2]]
    cfg_text = one(objects, "ConfigMap", "bluecache-config")["data"]["hostd.yaml"]
    path = tmp_path / "hostd.yaml"
    path.write_text(cfg_text)
    cfg = load_hostd_config(path, assignments=sets)
    assert cfg.daemon.control == endpoints["control"]
    mounts = {m["name"]: m["mountPath"] for m in hostd["volumeMounts"]}
    assert mounts["curve"] == str(cfg.daemon.curve_dir)


def test_mount_propagation_and_the_consumer_volume_agree(rendered):
    example = yaml.safe_load((KUBE / "consumer/vllm-example.yaml").read_text())
    pv = one(rendered["consumer"], "PersistentVolume")
    pvc = one(rendered["consumer"], "PersistentVolumeClaim")
    for name in OVERLAYS:
        objects = rendered[name]
        spec = one(objects, "DaemonSet")["spec"]["template"]["spec"]
        hostd = containers(objects)["hostd"]
        parent = next(m for m in hostd["volumeMounts"] if m["name"] == "mount-parent")
        assert parent["mountPropagation"] == "Bidirectional"
        volume = next(v for v in spec["volumes"] if v["name"] == "mount-parent")
        mountpoint = Path(config_file(objects, "hostd.yaml")["mountpoint"])
        # The FUSE mount sits directly under the propagated parent.
        assert mountpoint.parent == Path(parent["mountPath"]), name
        assert pv["spec"]["hostPath"]["path"] == volume["hostPath"]["path"], name
    assert pv["spec"]["hostPath"]["type"] == "Directory"    # never a bare dir made for the pod
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == pv["spec"]["storageClassName"]

    pod = example["spec"]["template"]["spec"]
    (claim,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mountpoint = config_file(rendered["embedded"], "hostd.yaml")["mountpoint"]
    for c in pod["initContainers"] + pod["containers"]:
        (m,) = [m for m in c["volumeMounts"] if m["name"] == claim["name"]]
        assert m["mountPropagation"] == "HostToContainer", c["name"]
        assert m["mountPath"] == str(Path(mountpoint).parent)
    (guard,) = pod["initContainers"]
    assert guard["args"] == ["wait-mount", mountpoint]
    assert f'"shared_storage_path": "{mountpoint}"' in " ".join(pod["containers"][0]["args"])


def test_probes_and_metrics_ports_follow_the_configs(rendered):
    for name in OVERLAYS:
        objects = rendered[name]
        c = containers(objects)
        service_ports = {p["name"]: p for p in one(objects, "Service")["spec"]["ports"]}
        files = {"hostd": "hostd.yaml", "bluecached": "bluecached.yaml"}
        for cname, container in c.items():
            listen = config_file(objects, files[cname])["metrics"]["listen"]
            host, port = listen.rsplit(":", 1)
            assert host == "0.0.0.0", (name, cname)     # the pod network, not loopback
            (cport,) = container["ports"]
            assert cport["containerPort"] == int(port)
            assert service_ports[cport["name"]]["port"] == int(port)
            probe = container["readinessProbe"]["httpGet"]
            assert (probe["path"], probe["port"]) == ("/readyz", cport["name"])
        assert "livenessProbe" not in c["hostd"]    # a restart of hostd costs the mount
    monitor = one(rendered["monitoring"], "ServiceMonitor")
    service = one(rendered["monitoring"], "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == \
        {p["name"] for p in service["spec"]["ports"]}


def test_memory_request_is_the_dram_tier_arithmetic(rendered):
    for name in ("embedded", "remote", "monitoring"):
        objects = rendered[name]
        dram = config_file(objects, "bluecached.yaml")["tiers"]["dram"]
        want = parse_size(dram["size"]) + parse_size(dram["prefault"]) + (PROCESS_MIB << 20)
        resources = containers(objects)["bluecached"]["resources"]
        assert parse_size(resources["requests"]["memory"].replace("Mi", "MiB")
                          .replace("Gi", "GiB")) == want, name
        assert parse_size(resources["limits"]["memory"].replace("Gi", "GiB")) >= want


def test_grace_period_covers_bluecacheds_stop_timeout(rendered):
    unit = (ROOT / "systemd/bluecached.service").read_text()
    (stop,) = [line.split("=")[1] for line in unit.splitlines()
               if line.startswith("TimeoutStopSec=")]
    for name in ("embedded", "remote", "monitoring"):
        spec = one(rendered[name], "DaemonSet")["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= int(stop), name


# Secrets the user creates (docs/kubernetes.md): their keys cannot live in the repository.
USER_SECRETS = {"bluecache-s3", "bluecache-curve"}


def test_every_reference_names_a_rendered_object_in_the_namespace(rendered):
    """A generated ConfigMap's hashed name must reach every reference to it, which kustomize
    does only within one namespace."""
    for name in OVERLAYS:
        objects = rendered[name]
        for o in objects:
            if o["kind"] != "Namespace":
                assert o["metadata"].get("namespace") == "bluecache", (name, o["kind"])
        configmaps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
        spec = one(objects, "DaemonSet")["spec"]["template"]["spec"]
        refs = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
        secrets = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    refs.append(ref["configMapKeyRef"]["name"])
                    data = next(o["data"] for o in objects
                                if o["metadata"]["name"] == ref["configMapKeyRef"]["name"])
                    assert ref["configMapKeyRef"]["key"] in data
                if "secretKeyRef" in ref:
                    secrets.append(ref["secretKeyRef"]["name"])
        assert set(refs) <= configmaps, (name, refs, configmaps)
        assert set(secrets) <= USER_SECRETS, (name, secrets)
