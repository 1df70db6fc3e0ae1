"""The real node of `make cluster`: pods run in real containers, beside KWOK's fake node pools.

containerd 2 (Go modules) with runc and a CNI bridge (Debian's plugins), a kubelet from the control plane's own
`k8s.io/kubernetes` build, kube-proxy (same build; iptables) so pods reach Services (the API server's among them,
as an in-cluster operator does), and CoreDNS (Go modules) serving cluster.local from the API server, so JobSet's pod
hostnames resolve. The pause binary is compiled from the kubernetes module's C source and the images `make images`
built are imported into containerd's `k8s.io` namespace (pods use `imagePullPolicy: IfNotPresent`; no registry is
reachable). The node is tainted ``wanloom.dev/real-node=true:NoSchedule`` and labelled ``wanloom.dev/real-node:
"true"``: only pods that ask for it run here, so the fake pools keep serving the placement tests.

The kubelet needs root and this host's cgroups v1 (``failCgroupV1: false``, cgroupfs); containerd restricts the
sandbox's oom_score_adj (no CAP_SYS_RESOURCE here). State lives under /var/lib/wanloom-node (containerd's images
survive a restart) and /run/wanloom-node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

NAME = "wanloom-node"
LABEL = "wanloom.dev/real-node"
ROOT_DIR = Path("/var/lib/wanloom-node")
RUN_DIR = Path("/run/wanloom-node")
SOCKET = RUN_DIR / "containerd.sock"
POD_SUBNET, POD_GATEWAY = "10.89.0.0/24", "10.89.0.1"
CNI_PLUGINS = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
IMAGES = ("ghcr.io/wanloom/wanloom-operator:0.1.0", "ghcr.io/wanloom/wanloom-trainer-tpu:0.1.0")
# Imported too where `make images IMAGES="operator tpu gpu"` built it (6 GB: not in CI).
OPTIONAL_IMAGES = ("ghcr.io/wanloom/wanloom-trainer-gpu:0.1.0",)
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(Path(__file__).resolve().parents[1] / "images/containers.conf")}
READY_TIMEOUT_S = 120


def unavailable() -> str | None:
    """Why this host cannot run the node, or None."""
    if os.geteuid() != 0:
        return "the kubelet and containerd need root"
    if shutil.which("podman") is None or not (CNI_PLUGINS / "bridge").exists():
        return "podman and the CNI plugins are missing (make images installs them)"
    missing = [i for i in IMAGES if not _built(i)]
    if missing:
        return f"{', '.join(missing)} not built (make images)"
    return None


def _built(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], env=PODMAN_ENV).returncode == 0


def host_ip() -> str:
    """The address pods reach this host by (its default route's source): API server, kubelet, DNS, test services."""
    out = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True, text=True).stdout.split()
    if "src" in out:
        return out[out.index("src") + 1]
    return subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()[0]


def ctr(bins: dict[str, Path], *args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(bins["CONTAINERD_BIN"] / "ctr"), "--address", str(SOCKET), "-n", "k8s.io", *args],
        check=True,
        capture_output=True,
        **kwargs,
    )


def _containerd_config(state: Path, pause: str) -> Path:
    config = f"""version = 3
root = '{ROOT_DIR / "containerd"}'
state = '{RUN_DIR / "containerd"}'
[grpc]
  address = '{SOCKET}'
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{pause}'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{shutil.which("runc") or "runc"}'
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{CNI_PLUGINS}']
  conf_dir = '{state / "cni"}'
"""
    (state / "cni").mkdir(exist_ok=True)
    bridge = {
        "cniVersion": "1.0.0",
        "name": "wanloom",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "wanloom0",
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (state / "cni" / "10-wanloom.conflist").write_text(json.dumps(bridge, indent=1))
    path = state / "containerd.toml"
    path.write_text(config)
    return path


def _pause_image(bins: dict[str, Path], state: Path) -> str:
    """registry.k8s.io/pause at the kubernetes release's tag, built from the compiled binary."""
    k8s = bins["KUBERNETES_BIN"]
    tag = f"registry.k8s.io/pause:{(k8s / 'pause.version').read_text().strip()}"
    build = state / "pause-image"
    build.mkdir(exist_ok=True)
    shutil.copy(k8s / "pause", build / "pause")
    (build / "Containerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
    subprocess.run(["buildah", "bud", "--quiet", "--isolation=chroot", "-t", tag, str(build)],
                   env=PODMAN_ENV, check=True, capture_output=True)  # fmt: skip
    return tag


def _import(bins: dict[str, Path], image: str) -> str:
    """Copy ``image`` from the containers storage into containerd, unless this build of it is already there.

    Returns the image's ID (its config digest, as podman and containerd's CRI both name it).
    """
    image_id = subprocess.run(["podman", "image", "inspect", "-f", "{{.Id}}", image], env=PODMAN_ENV,
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    stamp = ROOT_DIR / "imported" / image.replace("/", "_").replace(":", "_")
    if stamp.exists() and stamp.read_text() == image_id:
        return image_id
    archive = ROOT_DIR / "import.tar"
    subprocess.run(["podman", "save", "--format", "oci-archive", "-o", str(archive), image],
                   env=PODMAN_ENV, check=True, capture_output=True)  # fmt: skip
    ctr(bins, "images", "import", str(archive))
    archive.unlink()
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(image_id)
    return image_id


def _drop_other_images(bins: dict[str, Path], ids: dict[str, str]) -> None:
    """Remove every image but ``ids`` (name -> ID) from containerd, and with them their layers and snapshots.

    Each build's import leaves the previous one behind under its ID (the CRI names images ``sha256:<id>`` too), so
    without this the store grew by the 2 GB trainer image per `make images` until CI's disk was full.
    """
    keep = {*ids, *(f"sha256:{image_id}" for image_id in ids.values())}
    names = ctr(bins, "images", "ls", "-q", text=True).stdout.split()
    stale = [name for name in names if name not in keep]
    if stale:
        ctr(bins, "images", "rm", "--sync", *stale)


def _kubelet_config(state: Path, ip: str, port: int, healthz: int) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # The API server reaches the kubelet (logs, exec) without credentials; the node serves this host only.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "address": ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{SOCKET}",
        "clusterDomain": "cluster.local",
        "clusterDNS": [ip],
        "resolvConf": "/etc/resolv.conf",
        "registerWithTaints": [{"key": LABEL, "value": "true", "effect": "NoSchedule"}],
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        # Never collect the imported images: they cannot be pulled back.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
    }
    path = state / "kubelet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _corefile(state: Path, ip: str, kubeconfig: Path) -> Path:
    path = state / "Corefile"
    path.write_text(
        f"cluster.local:53 {{\n  bind {ip}\n  kubernetes cluster.local {{\n    kubeconfig {kubeconfig} wanloom-test\n"
        f"    pods insecure\n  }}\n}}\n.:53 {{\n  bind {ip}\n  forward . /etc/resolv.conf\n}}\n"
    )
    return path


def up(
    bins: dict[str, Path],
    state: Path,
    start: Callable[[str, list[str | Path]], None],
    kubeconfigs: dict[str, Path],
    free_port: Callable[[], int],
) -> dict[str, Any]:
    """Start containerd, import the images, start CoreDNS and the kubelet; wait for the node to be Ready."""
    from kubernetes import client, config

    node_state = state / "node"
    node_state.mkdir(exist_ok=True)
    for path in (ROOT_DIR, RUN_DIR):
        path.mkdir(parents=True, exist_ok=True)
    ip = host_ip()
    pause = _pause_image(bins, node_state)
    start("containerd", [bins["CONTAINERD_BIN"] / "containerd", f"--config={_containerd_config(node_state, pause)}"])
    os.environ["PATH"] = f"{bins['CONTAINERD_BIN']}:{os.environ['PATH']}"  # the shim, for containerd's children
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not SOCKET.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    images = [*IMAGES, *(i for i in OPTIONAL_IMAGES if _built(i))]
    _drop_other_images(bins, {image: _import(bins, image) for image in (pause, *images)})
    deadline = time.monotonic() + READY_TIMEOUT_S  # a first import takes minutes (the GPU image's 6 GB)
    start("coredns", [bins["COREDNS_BIN"] / "coredns", "-conf", _corefile(node_state, ip, kubeconfigs["coredns"])])
    port = free_port()
    start("kubelet", [
        bins["KUBERNETES_BIN"] / "kubelet", f"--config={_kubelet_config(node_state, ip, port, free_port())}",
        f"--kubeconfig={kubeconfigs['kubelet']}", f"--hostname-override={NAME}", f"--node-ip={ip}",
        f"--node-labels={LABEL}=true", f"--root-dir={ROOT_DIR / 'kubelet'}", "--v=1",
    ])  # fmt: skip
    healthz = free_port()
    start("kube-proxy", [
        bins["KUBERNETES_BIN"] / "kube-proxy", f"--kubeconfig={kubeconfigs['kube-proxy']}", "--proxy-mode=iptables",
        f"--hostname-override={NAME}", f"--cluster-cidr={POD_SUBNET}", f"--healthz-bind-address=127.0.0.1:{healthz}",
        f"--metrics-bind-address=127.0.0.1:{free_port()}", "--conntrack-max-per-core=0", "--v=1",
    ])  # fmt: skip
    config.load_kube_config(str(kubeconfigs["admin"]))
    core = client.CoreV1Api()
    while time.monotonic() < deadline:
        try:
            node = core.read_node(NAME)
            ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or ())
            if ready and _healthy(f"http://127.0.0.1:{healthz}/healthz"):
                ctr_bin = str(bins["CONTAINERD_BIN"] / "ctr")
                return {"name": NAME, "ip": ip, "label": LABEL, "images": images, "ctr": ctr_bin,
                        "socket": str(SOCKET)}  # fmt: skip
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        time.sleep(0.5)
    raise SystemExit(f"up.py: node {NAME} not Ready (or kube-proxy not synced) after {READY_TIMEOUT_S} s; see "
                     f"{state / 'logs'} (kubelet.log, kube-proxy.log)")  # fmt: skip


def _healthy(url: str) -> bool:
    """kube-proxy answers 200 on /healthz once it has written the Services' rules."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
