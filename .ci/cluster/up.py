"""Start a real Kubernetes control plane on 127.0.0.1 for the end-to-end tests (`make cluster`).

etcd, kube-apiserver (RBAC on, token and client-certificate authentication, an audit log), kube-controller-manager,
kube-scheduler, the JobSet controller and Kueue (its JobSet integration) with their webhooks served to the API
server by URL, KWOK driving fake nodes labelled like GKE TPU v7x and GPU node pools, and one real node where the
images `make images` built are present (``node.py``: containerd, a kubelet, kube-proxy, CoreDNS), with a GCS
emulator its pods reach (``gcs.py``). Kueue reads its metrics
certificate from a fixed path, /etc/kueue/metrics/certs, so up.py runs as root (as CI does). Binaries come from
``build.sh`` (Go modules, cached per version). State lives in ``.cluster/``: ``kubeconfig`` (cluster admin),
``env`` (ports and paths the tests read), ``pids/`` (what ``down.py`` stops), ``args/`` (what ``component.py``
restarts with) and ``logs/``.

Usage: python .ci/cluster/up.py   (idempotent: a running cluster is left as it is)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node  # the real node, beside this script

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("WANLOOM_CLUSTER_DIR", ROOT / ".cluster"))
HERE = Path(__file__).resolve().parent
# Identities with static tokens. The controller manager and scheduler get the users the bootstrap RBAC policy
# grants; JobSet and KWOK stand in for cluster add-ons and run as cluster admins, as they do when installed.
IDENTITIES = {
    "admin": ("admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", ""),
    "scheduler": ("system:kube-scheduler", ""),
    "jobset": ("system:jobset-controller", "system:masters"),
    "kwok": ("system:kwok-controller", "system:masters"),
    "kueue": ("system:kueue-controller", "system:masters"),
    "kubelet": (f"system:node:{node.NAME}", "system:nodes"),
    "coredns": ("system:coredns", "system:masters"),
    # The bootstrap policy's system:node-proxier binding names this user.
    "kube-proxy": ("system:kube-proxy", ""),
}
READY_TIMEOUT_S = 120
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "jobset-controller",
    "kueue",
    "kwok",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str | Path) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True)


def certificates(pki: Path, host_ip: str) -> None:
    """A CA, the API server's and the JobSet webhook's serving certificates, and the service-account key pair.

    Pods reach the API server at the ``kubernetes`` Service's address (10.96.0.1, through kube-proxy) and that
    leads to ``host_ip``: both are in its certificate. Made again when the host's address changed."""
    if (pki / "apiserver.ext").exists() and f"IP:{host_ip}," in (pki / "apiserver.ext").read_text():
        return
    shutil.rmtree(pki, ignore_errors=True)
    pki.mkdir(parents=True)
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=wanloom-test-ca",
        "-keyout", pki / "ca.key", "-out", pki / "ca.crt")  # fmt: skip
    sans = {
        "apiserver": f"IP:127.0.0.1,IP:{host_ip},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        "webhook": "IP:127.0.0.1,DNS:localhost",
    }
    for name, san in sans.items():
        (pki / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", pki / f"{name}.key",
            "-out", pki / f"{name}.csr")  # fmt: skip
        run("openssl", "x509", "-req", "-in", pki / f"{name}.csr", "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
            "-CAcreateserial", "-days", "30", "-extfile", pki / f"{name}.ext", "-out", pki / f"{name}.crt")  # fmt: skip
    run("openssl", "genrsa", "-out", pki / "sa.key", "2048")
    run("openssl", "rsa", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub")
    webhook = pki / "webhook-serving"
    webhook.mkdir()
    shutil.copy(pki / "webhook.crt", webhook / "tls.crt")
    shutil.copy(pki / "webhook.key", webhook / "tls.key")


def tokens(path: Path) -> dict[str, str]:
    found = {}
    if path.exists():
        for line in path.read_text().splitlines():
            token, user, *_ = line.split(",")
            found[user] = token
    out = {}
    lines = []
    for key, (user, group) in IDENTITIES.items():
        token = found.get(user) or base64.b32encode(os.urandom(20)).decode().lower()
        out[key] = token
        lines.append(f'{token},{user},{user},"{group}"' if group else f"{token},{user},{user}")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return out


def kubeconfig(path: Path, server: str, ca: Path, token: str) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "wanloom-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "wanloom-test", "context": {"cluster": "wanloom-test", "user": "user"}}],
        "current-context": "wanloom-test",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)


def start(name: str, args: list[str | Path]) -> None:
    pid_file = STATE / "pids" / f"{name}.pid"
    # component.py starts it again with the same arguments (the fault tests restart the API server, the kubelet).
    (STATE / "args").mkdir(exist_ok=True)
    (STATE / "args" / f"{name}.json").write_text(json.dumps([str(a) for a in args]))
    log = open(STATE / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file.write_text(str(proc.pid))
    time.sleep(0.2)
    if proc.poll() is not None:
        raise SystemExit(f"up.py: {name} exited at start ({proc.returncode}); see {log.name}")


def alive(name: str) -> bool:
    pid_file = STATE / "pids" / f"{name}.pid"
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def wait_url(name: str, url: str, token: str | None = None, ca: Path | None = None) -> None:
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not alive(name):
            raise SystemExit(f"up.py: {name} died; see {STATE / 'logs' / f'{name}.log'}")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"up.py: {name} not ready at {url} after {READY_TIMEOUT_S} s; see {STATE / 'logs'}")


def binaries() -> dict[str, Path]:
    # stderr passes through: a cold build runs ~20 min and its progress and errors belong in the CI log.
    out = subprocess.run([str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True).stdout
    return {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    # Service accounts (the operator on the chart's RBAC) in full, and the admin's writes and pod lists (the
    # operator run as admin: how many JobSets it really created, how often it looks for rank 0).
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "Metadata", "users": ["admin"], "verbs": ["create", "update", "patch", "delete"]},
        {"level": "Metadata", "users": ["admin"], "verbs": ["list"], "resources": [{"resources": ["pods"]}]},
        {"level": "None"},
    ],
}


def control_plane(bins: dict[str, Path], env: dict[str, Any], token: dict[str, str]) -> None:
    pki = STATE / "pki"
    k8s = bins["KUBERNETES_BIN"]
    start("etcd", [
        bins["ETCD_BIN"] / "etcd", "--name=default", f"--data-dir={STATE / 'etcd'}", "--log-level=warn",
        f"--listen-client-urls=http://127.0.0.1:{env['etcd_port']}",
        f"--advertise-client-urls=http://127.0.0.1:{env['etcd_port']}",
        f"--listen-peer-urls=http://127.0.0.1:{env['etcd_peer_port']}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{env['etcd_peer_port']}",
        f"--initial-cluster=default=http://127.0.0.1:{env['etcd_peer_port']}",
    ])  # fmt: skip
    wait_url("etcd", f"http://127.0.0.1:{env['etcd_port']}/health")
    (STATE / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    start("kube-apiserver", [
        k8s / "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{env['etcd_port']}",
        # Also on the host's address, which the `kubernetes` Service advertises to pods on the real node.
        "--bind-address=0.0.0.0", f"--advertise-address={env['host_ip']}", f"--secure-port={env['apiserver_port']}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={STATE / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC", f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        f"--audit-policy-file={STATE / 'audit-policy.yaml'}", f"--audit-log-path={STATE / 'logs' / 'audit.log'}",
    ])  # fmt: skip
    wait_url("kube-apiserver", f"{env['server']}/readyz", token["admin"], pki / "ca.crt")
    for identity in ("controller-manager", "scheduler"):
        kubeconfig(STATE / f"{identity}.kubeconfig", env["server"], pki / "ca.crt", token[identity])
    start("kube-controller-manager", [
        k8s / "kube-controller-manager", f"--kubeconfig={STATE / 'controller-manager.kubeconfig'}",
        "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        "--use-service-account-credentials=true", f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}", f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}", "--concurrent-gc-syncs=5",
    ])  # fmt: skip
    start("kube-scheduler", [
        k8s / "kube-scheduler", f"--kubeconfig={STATE / 'scheduler.kubeconfig'}", "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
    ])  # fmt: skip


def jobset(bins: dict[str, Path], env: dict[str, Any], token: dict[str, str]) -> None:
    """The JobSet CRD and controller; its webhooks are registered by URL with the test CA as their caBundle."""
    from kubernetes import client, config

    config.load_kube_config(str(STATE / "kubeconfig"))
    api = client.ApiClient()
    crd = yaml.safe_load((bins["JOBSET_BIN"] / "jobset-crd.yaml").read_text())
    ext = client.ApiextensionsV1Api(api)
    if not ext.list_custom_resource_definition(field_selector=f"metadata.name={crd['metadata']['name']}").items:
        ext.create_custom_resource_definition(crd)
    pki = STATE / "pki"
    cfg = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": env["jobset_webhook_port"], "host": "127.0.0.1", "certDir": str(pki / "webhook-serving")},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{env['jobset_health_port']}"},
    }
    (STATE / "jobset-config.yaml").write_text(yaml.safe_dump(cfg))
    kubeconfig(STATE / "jobset.kubeconfig", env["server"], pki / "ca.crt", token["jobset"])
    start("jobset-controller", [
        bins["JOBSET_BIN"] / "jobset-controller", f"--config={STATE / 'jobset-config.yaml'}",
        f"--kubeconfig={STATE / 'jobset.kubeconfig'}",
        f"--health-probe-bind-address=127.0.0.1:{env['jobset_health_port']}",
    ])  # fmt: skip
    wait_url("jobset-controller", f"http://127.0.0.1:{env['jobset_health_port']}/readyz")
    register_webhooks(api, bins["JOBSET_BIN"] / "jobset-webhooks.yaml", "jobset", env["jobset_webhook_port"])


def register_webhooks(api: Any, manifest: Path, prefix: str, port: int, groups: tuple[str, ...] = ()) -> None:
    """A controller's webhook configurations, pointed at 127.0.0.1:``port`` by URL with the test CA as caBundle.

    ``groups``: keep only the webhooks for these API groups (a controller serves only the integrations it runs;
    a registered webhook nobody serves would refuse every such request).
    """
    from kubernetes import client

    ca_bundle = base64.b64encode((STATE / "pki" / "ca.crt").read_bytes()).decode()
    admission = client.AdmissionregistrationV1Api(api)
    for doc in yaml.safe_load_all(manifest.read_text()):
        if not doc:
            continue
        doc["metadata"] = {"name": f"{prefix}-{doc['metadata']['name']}"}
        if groups:
            doc["webhooks"] = [
                h for h in doc["webhooks"] if {g for r in h["rules"] for g in r["apiGroups"]} <= set(groups)
            ]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
        create, replace = (
            (admission.create_mutating_webhook_configuration, admission.replace_mutating_webhook_configuration)
            if doc["kind"] == "MutatingWebhookConfiguration"
            else (admission.create_validating_webhook_configuration, admission.replace_validating_webhook_configuration)
        )
        try:
            create(doc)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            replace(doc["metadata"]["name"], doc)


def kueue(bins: dict[str, Path], env: dict[str, Any], token: dict[str, str]) -> None:
    """Kueue's CRDs and controller with its JobSet and batch Job integrations; its webhooks registered by URL, as
    JobSet's."""
    from kubernetes import client, config

    config.load_kube_config(str(STATE / "kubeconfig"))
    api = client.ApiClient()
    ext = client.ApiextensionsV1Api(api)
    names = []
    for path in sorted((bins["KUEUE_BIN"] / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        if not ext.list_custom_resource_definition(field_selector=f"metadata.name={names[-1]}").items:
            ext.create_custom_resource_definition(crd)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:  # Kueue indexes its kinds at start: they must be served first
        established = {
            crd.metadata.name
            for crd in ext.list_custom_resource_definition().items
            if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
        }
        if set(names) <= established:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"up.py: Kueue's CRDs not Established: {sorted(set(names) - established)}")
        time.sleep(0.3)
    core = client.CoreV1Api(api)
    if not core.list_namespace(field_selector="metadata.name=kueue-system").items:
        core.create_namespace({"metadata": {"name": "kueue-system"}})
    cfg = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": env["kueue_webhook_port"], "host": "127.0.0.1",
                    "certDir": str(STATE / "pki" / "webhook-serving")},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{env['kueue_health_port']}"},
        "manageJobsWithoutQueueName": False,
        # JobSets (TrainingJobs) and plain Jobs (a LatentDataset's steps).
        "integrations": {"frameworks": ["jobset.x-k8s.io/jobset", "batch/job"]},
    }  # fmt: skip
    (STATE / "kueue-config.yaml").write_text(yaml.safe_dump(cfg))
    # With its own certificate management off, Kueue reads its metrics server's certificate from a fixed path.
    metrics_certs = Path("/etc/kueue/metrics/certs")
    try:
        metrics_certs.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copy(STATE / "pki" / "webhook-serving" / name, metrics_certs / name)
    except PermissionError:
        raise SystemExit(f"up.py: Kueue needs its metrics certificate at {metrics_certs}; run as root") from None
    kubeconfig(STATE / "kueue.kubeconfig", env["server"], STATE / "pki" / "ca.crt", token["kueue"])
    start("kueue", [
        bins["KUEUE_BIN"] / "kueue", f"--config={STATE / 'kueue-config.yaml'}",
        f"--kubeconfig={STATE / 'kueue.kubeconfig'}",
        "--feature-gates=VisibilityOnDemand=false",  # an aggregated API server of its own, with its own certificates
    ])  # fmt: skip
    wait_url("kueue", f"http://127.0.0.1:{env['kueue_health_port']}/readyz")
    register_webhooks(api, bins["KUEUE_BIN"] / "kueue-webhooks.yaml", "kueue", env["kueue_webhook_port"],
                      ("kueue.x-k8s.io", "jobset.x-k8s.io", "batch"))  # fmt: skip


def kwok(bins: dict[str, Path], env: dict[str, Any], token: dict[str, str]) -> None:
    kubeconfig(STATE / "kwok.kubeconfig", env["server"], STATE / "pki" / "ca.crt", token["kwok"])
    start("kwok", [
        bins["KWOK_BIN"] / "kwok", f"--kubeconfig={STATE / 'kwok.kubeconfig'}", f"--config={HERE / 'kwok-stages.yaml'}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-lease-duration-seconds=40",
        "--cidr=10.244.0.0/16", "--node-ip=10.0.0.1", f"--server-address=127.0.0.1:{free_port()}",
    ])  # fmt: skip


def _node_pools() -> list[tuple[str, int, dict[str, str], dict[str, str], str | None]]:
    """Fake node pools, labelled, tainted and sized as GKE provisions them (the operator's own machine table):
    (pool, nodes, labels, capacity, taint key)."""
    from wanloom_api.topology import ACCELERATOR_TYPES

    def capacity(kind: str, resource: str) -> dict[str, str]:
        m = ACCELERATOR_TYPES[kind].machine
        return {"cpu": str(m.vcpus), "memory": f"{m.memory_gb}G", resource: str(m.accelerators)}

    pools = [("cpu", 2, {}, {"cpu": "16", "memory": "64Gi"}, None)]
    for kind in ("h100", "h200"):
        labels = {"cloud.google.com/gke-accelerator": ACCELERATOR_TYPES[kind].gke_label}
        pools.append((kind, 2, labels, capacity(kind, "nvidia.com/gpu"), "nvidia.com/gpu"))
    for topology, hosts, count in (("2x2x1", 1, 2), ("2x2x2", 2, 1), ("4x4x4", 16, 2), ("4x8x8", 64, 1)):
        labels = {"cloud.google.com/gke-tpu-accelerator": "tpu7x", "cloud.google.com/gke-tpu-topology": topology}
        for k in range(count):
            pools.append(
                (f"tpu7x-{topology}-{k}", hosts, labels, capacity("tpu7x", "google.com/tpu"), "google.com/tpu")
            )
    return pools


def fake_nodes() -> None:
    """Nodes that KWOK keeps Ready and whose pods it runs (kwok-stages.yaml: Job pods run 4 s, then succeed)."""
    from kubernetes import client, config

    config.load_kube_config(str(STATE / "kubeconfig"))
    core = client.CoreV1Api()
    for pool, count, labels, capacity, taint in _node_pools():
        for i in range(count):
            name = f"{pool}-{i}"
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                               "kubernetes.io/arch": "amd64", "cloud.google.com/gke-nodepool": pool, **labels},
                },
                "spec": {"taints": [{"key": taint, "value": "present", "effect": "NoSchedule"}] if taint else []},
                "status": {"capacity": {**capacity, "pods": "110"}, "allocatable": {**capacity, "pods": "110"}},
            }  # fmt: skip
            try:
                core.create_node(node)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise


def real_node(bins: dict[str, Path], env: dict[str, Any], token: dict[str, str]) -> dict[str, Any] | None:
    """The real node where this host can run it; else None, with the reason on stderr."""
    why = node.unavailable()
    if why:
        print(f"up.py: no real node: {why}; pods run on fake nodes only", file=sys.stderr)
        return None
    kubeconfigs = {"admin": STATE / "kubeconfig"}
    for identity in ("kubelet", "coredns", "kube-proxy"):
        kubeconfigs[identity] = STATE / f"{identity}.kubeconfig"
        kubeconfig(kubeconfigs[identity], env["server"], STATE / "pki" / "ca.crt", token[identity])
    return node.up(bins, STATE, start, kubeconfigs, free_port)


def storage(host: str) -> str:
    """A GCS emulator where the real node's pods reach it (``gcs.py``: every bucket a job names exists); its URL is what
    the chart's ``trainerPods.env`` gives pods as STORAGE_EMULATOR_HOST."""
    url = f"http://{host}:{free_port()}"
    start("gcs-emulator", [sys.executable, HERE / "gcs.py", host, url.rsplit(":", 1)[1]])
    wait_url("gcs-emulator", f"{url}/storage/v1/b?project=wanloom-test")
    return url


def main() -> None:
    if (STATE / "env").exists() and all(alive(n) for n in json.loads((STATE / "env").read_text())["components"]):
        print(f"cluster already running: KUBECONFIG={STATE / 'kubeconfig'}")
        return
    subprocess.run([sys.executable, str(HERE / "down.py")], check=True)
    started = time.monotonic()
    for sub in ("pids", "logs"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    bins = binaries()
    env: dict[str, Any] = {
        "host_ip": node.host_ip(),
        "etcd_port": free_port(),
        "etcd_peer_port": free_port(),
        "apiserver_port": free_port(),
        "jobset_webhook_port": free_port(),
        "jobset_health_port": free_port(),
        "kueue_webhook_port": free_port(),
        "kueue_health_port": free_port(),
    }
    env["server"] = f"https://127.0.0.1:{env['apiserver_port']}"
    certificates(STATE / "pki", env["host_ip"])
    token = tokens(STATE / "tokens.csv")
    kubeconfig(STATE / "kubeconfig", env["server"], STATE / "pki" / "ca.crt", token["admin"])
    control_plane(bins, env, token)
    jobset(bins, env, token)
    kueue(bins, env, token)
    kwok(bins, env, token)
    fake_nodes()
    env["components"] = list(COMPONENTS)
    env["node"] = real_node(bins, env, token)
    if env["node"]:
        env["gcs"] = storage(env["host_ip"])
        env["components"] += ["containerd", "coredns", "kubelet", "kube-proxy", "gcs-emulator"]
    env["kubeconfig"] = str(STATE / "kubeconfig")
    env["audit_log"] = str(STATE / "logs" / "audit.log")
    env["start_seconds"] = round(time.monotonic() - started, 1)
    (STATE / "env").write_text(json.dumps(env, indent=1))
    print(f"cluster up in {env['start_seconds']} s: KUBECONFIG={STATE / 'kubeconfig'}")


if __name__ == "__main__":
    main()
