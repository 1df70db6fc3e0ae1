"""values.schema.json and the chart's own checks reject bad values with messages that name the key and the rule."""

from __future__ import annotations

from typing import Any

import pytest

BAD_VALUES = {
    "unknown-top-level-key": ({"oprator": {"replicas": 2}}, ["additional properties 'oprator' not allowed"]),
    "unknown-nested-key": ({"operator": {"replica": 2}}, ["/operator", "'replica' not allowed"]),
    "replicas-not-a-number": ({"operator": {"replicas": "two"}}, ["/operator/replicas", "want integer"]),
    "zero-replicas": ({"operator": {"replicas": 0}}, ["/operator/replicas", "minimum"]),
    "privileged-port": ({"operator": {"metricsPort": 80}}, ["/operator/metricsPort", "minimum"]),
    "namespaced-without-namespaces": (
        {"operator": {"watch": {"allNamespaces": False}}},
        ["/operator/watch", "namespaces"],
    ),
    "bad-namespace-name": (
        {"operator": {"watch": {"allNamespaces": False, "namespaces": ["Team_A"]}}},
        ["/operator/watch/namespaces/0", "does not match pattern"],
    ),
    "bad-scrape-interval": ({"metrics": {"podMonitor": {"interval": "fast"}}}, ["/metrics/podMonitor/interval"]),
    "toggle-not-boolean": ({"crds": {"enabled": "yes"}}, ["/crds/enabled", "want boolean"]),
    "bad-pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, ["/image/pullPolicy"]),
    "bad-memory-quantity": (
        {"operator": {"resources": {"limits": {"memory": "lots"}}}},
        ["/operator/resources/limits/memory"],
    ),
    "extra-arg-not-a-flag": ({"operator": {"extraArgs": ["verbose"]}}, ["/operator/extraArgs/0"]),
    "rdma-without-networks": ({"gpuNetworking": {"ncclProfile": "gib"}}, ["/gpuNetworking", "interfaces"]),
    "dashboard-label-not-string": ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, ["/dashboard/labels"]),
}


@pytest.mark.parametrize(("values", "phrases"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values_naming_the_key(helm: Any, chart: Any, values: dict, phrases: list[str]) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    for phrase in phrases:
        assert phrase in str(err.value)
    with pytest.raises(helm.HelmValuesError):  # rendering (helm install/template) refuses them too
        chart.render(values, name="wanloom", namespace="wanloom-system")


TEMPLATE_CHECKS = {
    "same-port-twice": (
        {"operator": {"metricsPort": 8080, "livenessPort": 8080}},
        "operator.metricsPort and operator.livenessPort must differ",
    ),
    "service-monitor-without-service": (
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
        "metrics.serviceMonitor.enabled needs metrics.service.enabled",
    ),
    "external-service-account-without-name": (
        {"serviceAccount": {"create": False}},
        "serviceAccount.name is required when serviceAccount.create is false",
    ),
}


@pytest.mark.parametrize(("values", "message"), TEMPLATE_CHECKS.values(), ids=TEMPLATE_CHECKS.keys())
def test_combinations_the_schema_cannot_express_fail_at_render(
    helm: Any, chart: Any, values: dict, message: str
) -> None:
    chart.validate_schema(values)
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="wanloom", namespace="wanloom-system")


def test_defaults_satisfy_the_schema(chart: Any) -> None:
    chart.validate_schema(chart.values)
