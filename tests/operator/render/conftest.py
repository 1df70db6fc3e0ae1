"""Fixtures of the rendering tests: TrainingJob builders and validators of the rendered objects.

- JobSets against the upstream JobSet CRD schema (kubernetes-sigs/jobset 08dfbdf,
  config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml, copied to tests/operator/data/), with unknown fields
  rejected like ``kubectl --validate=strict``, plus the JobSet webhook's name and rule-name checks;
- the Job and pod template inside, and the ConfigMap, with kubernetes-validate --strict for Kubernetes 1.30 and the
  newest schema it ships.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from wanloom_api.trainingjob import TrainingJob
from wanloom_api.validation import parse_trainingjob
from wanloom_operator.settings import OperatorSettings

DATA = Path(__file__).resolve().parents[1] / "data"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

BASE_SPEC: dict[str, Any] = {
    "model": {"variant": "wan2.2-ti2v-5b"},
    "data": {"uri": "gs://bucket/data"},
    "training": {"steps": 10, "globalBatch": 4096},
}


@pytest.fixture(scope="session")
def settings() -> OperatorSettings:
    return OperatorSettings.from_env({})


@pytest.fixture(scope="session")
def make_job() -> Callable[..., TrainingJob]:
    def make(resources: dict[str, Any], name: str = "job", namespace: str = "team-a", **spec: Any) -> TrainingJob:
        doc = {
            "apiVersion": "wanloom.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {**copy.deepcopy(BASE_SPEC), "resources": resources, **spec},
        }
        return parse_trainingjob(doc, name)

    return make


@pytest.fixture(scope="session")
def jobset_schema() -> dict[str, Any]:
    crd = yaml.safe_load((DATA / "jobset.x-k8s.io_jobsets.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def check_jobset(jobset_schema: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """Raise with every problem of a rendered JobSet (schema, unknown fields, webhook rules, core schemas)."""

    validator_cls = jsonschema.validators.validator_for(jobset_schema)
    validator_cls.check_schema(jobset_schema)
    validator = validator_cls(jobset_schema)  # compiled once: validate() would re-check the 800 kB schema each call

    def check(jobset: dict[str, Any]) -> None:
        validator.validate(jobset)
        unknown = list(_unknown_fields(jobset, jobset_schema, ""))
        assert not unknown, f"fields the JobSet CRD does not know: {unknown}"
        _check_webhook_rules(jobset)
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(_as_job(jobset), version, strict=True)
            kubernetes_validate.validate(_metadata_carrier(jobset), version, strict=True)

    return check


@pytest.fixture(scope="session")
def check_core() -> Callable[[dict[str, Any]], None]:
    def check(obj: dict[str, Any]) -> None:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)

    return check


def _unknown_fields(node: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    """Paths of keys the structural schema would prune (the API server drops them silently)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")
        return
    if not isinstance(node, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in node.items():
                yield from _unknown_fields(value, extra, f"{path}.{key}")
        return  # an open object (e.g. root metadata): checked by the metadata carrier below
    for key, value in node.items():
        if key not in props:
            yield f"{path}.{key}"
        else:
            yield from _unknown_fields(value, props[key], f"{path}.{key}")


def _check_webhook_rules(jobset: dict[str, Any]) -> None:
    """The JobSet validating webhook's rules that a schema cannot express (pkg/webhooks/jobset_webhook.go)."""
    name = jobset["metadata"]["name"]
    for rjob in jobset["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        longest_pod = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}-{job_spec['completions'] - 1}-abcde"
        assert len(longest_pod) <= 63 and _DNS1035.match(longest_pod), f"pod name too long: {longest_pod}"
        assert job_spec["completionMode"] == "Indexed"
    for rule in jobset["spec"].get("failurePolicy", {}).get("rules", []):
        assert _RULE_NAME.match(rule["name"]), rule["name"]
    subdomain = jobset["spec"]["network"]["subdomain"]
    assert len(subdomain) <= 63 and _DNS1035.match(subdomain)
    assert "coordinator" not in jobset["spec"], "the coordinator label would exceed 63 chars for long names"


def _as_job(jobset: dict[str, Any]) -> dict[str, Any]:
    """The batch/v1 Job JobSet creates from the (single) replicated job's template."""
    template = jobset["spec"]["replicatedJobs"][0]["template"]
    metadata = {"name": f"{jobset['metadata']['name']}-x-0", "namespace": jobset["metadata"]["namespace"]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


def _metadata_carrier(jobset: dict[str, Any]) -> dict[str, Any]:
    """The JobSet's ObjectMeta, validated as a ConfigMap's (the CRD leaves root metadata to the API server)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": jobset["metadata"], "data": {}}
