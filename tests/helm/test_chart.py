"""The wanloom chart renders with the Helm SDK and every object it renders is valid, with defaults and toggles flipped.

Core objects are checked by kubernetes-validate (strict: unknown fields fail); PodMonitor and ServiceMonitor against
the Prometheus Operator's CRD schemas (copies in tests/helm/data/); kopf peering objects against the chart's own
peering CRDs. The RBAC tests pin least privilege: exactly the rules the operator needs, nothing else.
"""

from __future__ import annotations

import copy
import json
import sys
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from wanloom_api import keys

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "wanloom"
NAMESPACE = "wanloom-system"
DATA = Path(__file__).parent / "data"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MONITOR_CRDS = {
    "PodMonitor": DATA / "monitoring.coreos.com_podmonitors.yaml",
    "ServiceMonitor": DATA / "monitoring.coreos.com_servicemonitors.yaml",
}

Render = Callable[..., list[dict[str, Any]]]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "every-toggle-flipped": {
        "crds": {"enabled": False},
        "serviceAccount": {"create": False, "name": "platform-operator"},
        "rbac": {"create": False},
        "operator": {
            "replicas": 2,
            "watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]},
            "peering": {"name": "wanloom", "installCRDs": False},
        },
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "dashboard": {"enabled": False},
    },
    "monitoring-on": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "podMonitor": {"enabled": True, "interval": "5s", "scrapeTimeout": "4s"},
        },
        "dashboard": {"namespace": "monitoring", "labels": {"grafana_dashboard": "1", "team": "ml"}},
    },
    "cluster-ha": {"operator": {"replicas": 2}},
    "namespaced-ha": {
        "operator": {"replicas": 3, "watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}},
        "metrics": {"podMonitor": {"enabled": True}},
    },
    "no-metrics-service": {"metrics": {"service": {"enabled": False}}},
    "gpu-rdma": {"gpuNetworking": {"ncclProfile": "gib", "interfaces": ["gvnic-1", *(f"rdma-{i}" for i in range(8))]}},
    "alerts-and-policies": {
        "metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "networkPolicy": {
            "enabled": True,
            "trainerNamespaces": ["team-a", "team-b"],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        },
        "trainerPods": {
            "imagePullSecrets": ["registry"],
            "labels": {"team": "ml"},
            "env": [{"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs.storage:9023"}],
        },
    },
    "custom-image": {
        "image": {"repository": "registry.example/wanloom/operator", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {
            "extraArgs": ["--verbose"],
            "extraEnv": [{"name": "WANLOOM_EXTRA", "value": "1"}],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
            "priorityClassName": "system-cluster-critical",
        },
    },
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def _strict(schema: Any) -> Any:
    """A CRD schema as the API server applies it, but rejecting unknown fields instead of pruning them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    preserves = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserves:
        out["additionalProperties"] = False
    return out


def _crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])
    for field in ("apiVersion", "kind", "metadata"):  # checked by the API server itself
        schema["properties"].pop(field, None)
    return _strict(schema)


def _monitor_schema(kind: str) -> dict[str, Any]:
    return _crd_schema(yaml.safe_load(MONITOR_CRDS[kind].read_text()), "v1")


def _peering_schemas(render: Render) -> dict[str, dict[str, Any]]:
    crds = by_kind(render(VALUE_SETS["cluster-ha"]), "CustomResourceDefinition")
    return {c["spec"]["names"]["kind"]: _crd_schema(c, "v1") for c in crds if c["spec"]["group"] == "kopf.dev"}


def _validate(obj: dict[str, Any], peering_schemas: dict[str, dict[str, Any]]) -> None:
    kind = obj["kind"]
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    if kind == "PrometheusRule":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        _promtool_check(body["spec"])
    elif kind in MONITOR_CRDS:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.validate(body, _monitor_schema(kind))
    elif kind in peering_schemas:
        assert obj["apiVersion"] == "kopf.dev/v1"
        jsonschema.validate(body, peering_schemas[kind])
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def _promtool_check(spec: dict[str, Any]) -> None:
    """Prometheus's own checker on the rule groups (a PrometheusRule's spec is a rule file)."""
    import os
    import shutil
    import subprocess
    import tempfile

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("WANLOOM_REQUIRE_E2E"):
            pytest.fail("promtool (Debian's prometheus package, `make services`) is not installed")
        pytest.skip("promtool is not installed")
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump(spec, f)
        f.flush()
        checked = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates(render: Render, name: str) -> None:
    objects = render(VALUE_SETS[name])
    peering_schemas = _peering_schemas(render)
    assert objects
    for obj in objects:
        try:
            _validate(obj, peering_schemas)
        except Exception as err:  # name the object: a schema error alone does not say which one failed
            pytest.fail(f"[{name}] {obj['kind']}/{obj['metadata']['name']} is invalid: {err}")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_objects_are_unique_and_namespaced_ones_say_where(render: Render, name: str) -> None:
    objects = render(VALUE_SETS[name])
    keys_seen = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(keys_seen) == len(set(keys_seen))
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "ClusterKopfPeering"}
    for kind, namespace, obj_name in keys_seen:
        assert (namespace is None) == (kind in cluster_scoped), f"{kind}/{obj_name} namespace={namespace}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_lints_clean(helm: Any, name: str) -> None:
    report = helm.lint(str(CHART_DIR), VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_chart_version_matches_the_package() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == "0.1.0" == project["version"]


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_operator_runs_non_root_read_only_with_resources(render: Render) -> None:
    objects = render()
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    container = _container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert container["livenessProbe"]["httpGet"]["port"] == "liveness"


def test_default_operator_is_a_single_cluster_wide_replica(render: Render) -> None:
    objects = render()
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two unpeered operators at once
    container = _container(objects)
    assert container["command"] == ["wanloom", "operator"]
    assert container["args"] == ["--all-namespaces", "--metrics-port=8000", "--liveness-port=8080"]
    assert container["image"] == "ghcr.io/wanloom/wanloom-operator:0.1.0"
    assert not by_kind(objects, "ClusterKopfPeering") and not by_kind(objects, "KopfPeering")
    assert not by_kind(objects, "PodDisruptionBudget")  # maxUnavailable 1 of 1 would protect nothing
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}


def test_replicas_coordinate_through_a_cluster_peering(render: Render) -> None:
    objects = render(VALUE_SETS["cluster-ha"])
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--peering=wanloom" in _container(objects)["args"]
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    peering = one(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "wanloom"
    assert "post-install" in peering["metadata"]["annotations"]["helm.sh/hook"]  # after its CRD exists
    crd_names = {c["metadata"]["name"] for c in by_kind(objects, "CustomResourceDefinition")}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "trainingjobs.wanloom.dev",
            "latentdatasets.wanloom.dev"} == crd_names  # fmt: skip


def test_namespaced_operator_watches_and_peers_per_namespace(render: Render) -> None:
    objects = render(VALUE_SETS["namespaced-ha"])
    args = _container(objects)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in by_kind(objects, "KopfPeering")} == {
        ("team-a", "wanloom"),
        ("team-b", "wanloom"),
    }
    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


CRUD = {"get", "list", "watch", "create", "update", "patch", "delete"}
OPERATOR_RULES = {
    ("wanloom.dev", "trainingjobs"): {"get", "list", "watch", "patch"},
    ("wanloom.dev", "trainingjobs/status"): {"patch"},
    ("wanloom.dev", "trainingjobs/finalizers"): {"update"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("kueue.x-k8s.io", "workloads"): {"list", "patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
    ("wanloom.dev", "latentdatasets"): {"get", "list", "watch", "patch"},
    ("wanloom.dev", "latentdatasets/status"): {"patch"},
    ("wanloom.dev", "latentdatasets/finalizers"): {"update"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch"},
}
READ = {"get", "list", "watch"}
PEER = {"get", "list", "watch", "patch"}


def _grants(objects: list[dict[str, Any]], namespace: str | None) -> dict[tuple[str, str], set[str]]:
    """Everything the operator's service account may do in `namespace` (None: cluster-wide grants only)."""
    roles = {("ClusterRole", r["metadata"]["name"]): r for r in by_kind(objects, "ClusterRole")}
    roles |= {("Role", r["metadata"]["name"], r["metadata"]["namespace"]): r for r in by_kind(objects, "Role")}
    granted: dict[tuple[str, str], set[str]] = {}
    bindings = by_kind(objects, "ClusterRoleBinding")
    bindings += [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["namespace"] == namespace]
    for binding in bindings:
        ref = binding["roleRef"]
        key = (ref["kind"], ref["name"]) if ref["kind"] == "ClusterRole" else ("Role", ref["name"], namespace)
        for rule, verbs in _rules(roles[key]).items():
            granted.setdefault(rule, set()).update(verbs)
    return granted


@pytest.mark.parametrize(
    ("name", "namespace", "expected"),
    [
        ("defaults", None, OPERATOR_RULES | {("apiextensions.k8s.io", "customresourcedefinitions"): READ}),
        (
            "cluster-ha",
            None,
            OPERATOR_RULES
            | {("apiextensions.k8s.io", "customresourcedefinitions"): READ, ("kopf.dev", "clusterkopfpeerings"): PEER},
        ),
        ("namespaced-ha", None, {}),
        ("namespaced-ha", "team-a", OPERATOR_RULES | {("kopf.dev", "kopfpeerings"): PEER}),
        ("namespaced-ha", "default", {}),
    ],
    ids=["cluster", "cluster-ha", "namespaced-cluster-grants", "namespaced-in-watched", "namespaced-elsewhere"],
)
def test_rbac_is_exactly_what_the_operator_needs(
    render: Render, name: str, namespace: str | None, expected: dict[tuple[str, str], set[str]]
) -> None:
    assert _grants(render(VALUE_SETS[name]), namespace) == expected


def test_rbac_and_service_account_can_be_left_to_the_cluster_admin(render: Render) -> None:
    objects = render(VALUE_SETS["every-toggle-flipped"])
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    assert not by_kind(objects, "CustomResourceDefinition")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"


def test_pod_monitor_selects_the_trainer_pods_metrics_port(render: Render) -> None:
    monitor = one(render(VALUE_SETS["monitoring-on"]), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchLabels": {keys.LABEL_MANAGED_BY: keys.MANAGED_BY}}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "5s", "scrapeTimeout": "4s"}
    ]


def test_service_monitor_reaches_the_operator_through_its_service(render: Render) -> None:
    objects = render(VALUE_SETS["monitoring-on"])
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    container_ports = {p["name"] for p in _container(objects)["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in container_ports
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # keep the per-job `namespace` label


def test_dashboard_config_map_is_labelled_for_the_grafana_sidecar(render: Render) -> None:
    objects = render(VALUE_SETS["monitoring-on"])
    config_map = one(objects, "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART_DIR / "dashboards" / "wanloom.json").read_text())
    assert json.loads(config_map["data"]["wanloom.json"]) == shipped
    assert not by_kind(render(VALUE_SETS["every-toggle-flipped"]), "ConfigMap")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_notes_render_and_tell_how_to_watch_a_job(chart: Any, name: str) -> None:
    notes = chart.render(VALUE_SETS[name], name="wanloom", namespace=NAMESPACE)["wanloom/templates/NOTES.txt"]
    assert "kubectl get tj" in notes and "jobsets.jobset.x-k8s.io" in notes


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePolicy="Always")),
        ("ClusterRole", lambda o: o["rules"][0].update(verbs="get")),
        ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(scrapeEvery="5s")),
        ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(interval="5 seconds")),
        ("ServiceMonitor", lambda o: o["spec"].update(endpoints="metrics")),
        ("ClusterKopfPeering", lambda o: o.update(spec={"priority": 1})),
    ],
    ids=["unknown-field", "wrong-type", "monitor-unknown-field", "monitor-bad-duration", "monitor-type", "peering"],
)
def test_the_validators_catch_a_broken_object(render: Render, kind: str, mutate: Callable[[dict], None]) -> None:
    objects = render(VALUE_SETS["monitoring-on"] | VALUE_SETS["cluster-ha"])
    broken = copy.deepcopy(by_kind(objects, kind)[0])
    mutate(broken)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        _validate(broken, _peering_schemas(render))


def test_operator_environment_matches_operator_settings(render: Render) -> None:
    settings = pytest.importorskip("wanloom_operator.settings")
    env = {e["name"] for e in _container(render())["env"] if e["name"].startswith("WANLOOM_")}
    assert env <= set(settings.ENV.values()), env - set(settings.ENV.values())


@pytest.mark.parametrize("name", ["defaults", "namespaced-ha", "cluster-ha", "custom-image", "gpu-rdma"])
def test_operator_command_line_is_what_wanloom_operator_accepts(
    render: Render, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Run the real `wanloom operator` CLI with the rendered command, env and args, stopping before kopf starts."""
    cli = pytest.importorskip("wanloom_cli")
    from typer.testing import CliRunner

    captured = []
    runner_module = types.ModuleType("wanloom_operator.reconcile.runner")
    runner_module.run_operator = lambda settings, verbose=False: captured.append((settings, verbose))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wanloom_operator.reconcile.runner", runner_module)
    container = _container(render(VALUE_SETS[name]))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert container["command"] == ["wanloom", "operator"]
    result = CliRunner().invoke(cli.app, [container["command"][1], *container["args"]], env=env)
    assert result.exit_code == 0, result.output
    settings, verbose = captured[0]
    values = {**VALUE_SETS["defaults"], **VALUE_SETS[name]}.get("operator", {})
    watch = values.get("watch", {"allNamespaces": True})
    assert settings.namespaces == (() if watch["allNamespaces"] else tuple(watch["namespaces"]))
    assert settings.peering_name == ("wanloom" if values.get("replicas", 1) > 1 else None)
    assert (settings.metrics_port, settings.liveness_port) == (8000, 8080)
    assert settings.trainer_image_jax == "ghcr.io/wanloom/wanloom-trainer-tpu:0.1.0"
    assert settings.log_format == "json"
    assert verbose == ("--verbose" in container["args"])
    networking = VALUE_SETS[name].get("gpuNetworking", {"ncclProfile": "default", "interfaces": []})
    assert (settings.gpu_nccl_profile, list(settings.gpu_network_interfaces)) == (
        networking["ncclProfile"],
        networking["interfaces"],
    )


def test_alerts_name_the_job_and_policies_admit_the_operator_and_the_scraper(render: Render) -> None:
    objects = render(VALUE_SETS["alerts-and-policies"])
    rule = one(objects, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "WanloomTrainingStalled",
        "WanloomLoadImbalance",
        "WanloomStorageOutage",
        "WanloomJobRestarts",
    }
    assert all("by (namespace, trainingjob)" in r["expr"] for r in alerts.values())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in by_kind(objects, "NetworkPolicy")}
    assert set(policies) == {
        (NAMESPACE, "wanloom-operator"),
        ("team-a", "wanloom-trainers"),
        ("team-b", "wanloom-trainers"),
    }
    trainers = policies[("team-a", "wanloom-trainers")]["spec"]
    assert trainers["podSelector"] == {"matchLabels": {keys.LABEL_MANAGED_BY: keys.MANAGED_BY}}
    scrapers = trainers["ingress"][1]["from"]
    assert scrapers[0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert scrapers[1] == VALUE_SETS["alerts-and-policies"]["networkPolicy"]["metricsFrom"][0]
    assert trainers["ingress"][1]["ports"] == [{"port": "metrics"}]
    assert not by_kind(render(), "NetworkPolicy") and not by_kind(render(), "PrometheusRule")


def test_trainer_pod_defaults_reach_the_operator_as_settings(render: Render) -> None:
    settings = pytest.importorskip("wanloom_operator.settings")
    env = {e["name"]: e.get("value") for e in _container(render(VALUE_SETS["alerts-and-policies"]))["env"]}
    parsed = settings.OperatorSettings.from_env(env).trainer_pods
    assert parsed.image_pull_secrets == ("registry",) and parsed.labels == {"team": "ml"}
    assert [(v.name, v.value) for v in parsed.env] == [("STORAGE_EMULATOR_HOST", "http://gcs.storage:9023")]
